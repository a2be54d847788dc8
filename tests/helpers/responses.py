"""Checking Responses API events and objects against the official SDK's own types
(``openai.types.responses``): each event validated as the SDK's ``ResponseStreamEvent``
union, no field the SDK does not declare (but chatstream's own ``chatstream``), and the
whole sequence accumulated by the SDK's ``ResponseStreamState`` as ``responses.stream()``
does."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import openai
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
OUR_FIELDS = frozenset({"chatstream"})  # chatstream's additions (reset, the job's error code)
LIFECYCLE = ("response.created", "response.in_progress")
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def undeclared(model: Any, path: str = "") -> list[str]:
    """The paths of fields in ``model`` (and the models in it) the SDK does not declare."""
    found: list[str] = []
    if isinstance(model, BaseModel):
        found += [f"{path}.{name}" for name in model.model_extra or {} if name not in OUR_FIELDS]
        for name in type(model).model_fields:
            found += undeclared(getattr(model, name), f"{path}.{name}")
    elif isinstance(model, list | tuple):
        for index, item in enumerate(model):
            found += undeclared(item, f"{path}[{index}]")
    return found


def as_sdk_event(data: dict[str, Any]) -> Any:
    """One event as the SDK's type (validated), with nothing the SDK does not declare."""
    parsed = STREAM_EVENT.validate_python(data)
    assert parsed.type == data["type"]
    assert not undeclared(parsed), (data["type"], undeclared(parsed))
    return parsed


def as_sdk_response(data: dict[str, Any]) -> Response:
    parsed = Response.model_validate(data)
    assert not undeclared(parsed), undeclared(parsed)
    return parsed


def check_stream(events: Iterable[dict[str, Any]], first: int = 0) -> list[Any]:
    """The events as SDK types, once they are well formed: numbered on from ``first``
    without a gap; every output item added once and done at most once; nothing but
    keep-alives after a terminal event."""
    events = list(events)
    assert [e["sequence_number"] for e in events] == list(range(first, first + len(events)))
    if first == 0:
        assert tuple(e["type"] for e in events[:2]) == LIFECYCLE
    added = Counter(e["output_index"] for e in events if e["type"].endswith("output_item.added"))
    done = Counter(e["output_index"] for e in events if e["type"].endswith("output_item.done"))
    assert set(added.values()) <= {1} and set(done.values()) <= {1} and set(done) <= set(added)
    ends = [i for i, e in enumerate(events) if e["type"] in TERMINAL]
    assert ends in ([], [len(events) - 1]), [e["type"] for e in events]
    assert not any("error" in e for e in events)  # a top-level error: the SDK would raise
    return [as_sdk_event(e) for e in events]


def sdk_accumulated(events: Iterable[Any]) -> Any:
    """What the SDK's ``ResponseStreamState`` makes of the events (as ``responses.stream()``
    does; it raises on a sequence it cannot follow): the final response once a
    ``response.completed`` came, else None."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=openai.omit)
    for item in events:
        state.handle_event(item)
    return state._completed_response


SDK_PARSED = frozenset({"parsed", "parsed_arguments"})  # what ResponseStreamState adds


def plain(response: Any) -> Any:
    """A response (the SDK's, or its JSON) as JSON without what the SDK's parsing adds."""
    value = response.model_dump(mode="json") if isinstance(response, BaseModel) else response
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k not in SDK_PARSED}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value
