"""The entries of a job's events stream, as consumers read them (see docs/events.md).

A stream entry has three string fields: ``type``, ``attempt`` and ``data`` (compact JSON).
:class:`StreamEvent` is the decoded entry; the ``*Data`` models document (and let a
consumer validate) the ``data`` object of each type. The worker itself writes plain dicts.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.chunks import ReasoningDetail


class EventType(StrEnum):
    DELTA = "delta"
    RESET = "reset"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"
    WAITING = "waiting"


TERMINAL_EVENTS: frozenset[EventType] = frozenset(
    {EventType.DONE, EventType.ERROR, EventType.CANCELLED}
)


class _Data(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionFragment(_Data):
    """A fragment of a tool call's function: ``name`` once, ``arguments`` to concatenate."""

    name: str | None = Field(
        None, description="The function name; only on the first fragment that names it."
    )
    arguments: str | None = Field(
        None, description="A piece of the JSON arguments string; concatenate in order."
    )


class ToolCallFragment(_Data):
    """A tool-call fragment of a delta; fragments with the same ``index`` build one call."""

    index: int = Field(
        ge=0, description="Which call this fragment belongs to (always present, resolved)."
    )
    id: str | None = Field(None, description="The call id; only on the first fragment with it.")
    type: str | None = Field(
        None, description='The call type ("function"); only on the first fragment with it.'
    )
    function: FunctionFragment | None = Field(None, description="Name and/or arguments piece.")


class ChoiceDeltaData(_Data):
    """What one choice added: choice 0's keys are the top level of ``DeltaData``; with
    n > 1 the other choices' are under ``choices``, each with its ``index``.

    Only non-empty keys are present. Merge consecutive deltas in order: ``role`` is set
    once; ``content`` and ``refusal`` concatenate; ``tool_calls`` merge by ``index``
    (``id``, ``type`` and ``function.name`` keep the first non-empty value,
    ``function.arguments`` concatenate); a ``reasoning_details`` fragment joins the last
    entry when both have the same ``type`` (not ``reasoning.encrypted``), equal ``index``
    (or either has none) and the entry has no ``signature`` yet, concatenating ``text`` /
    ``summary`` and keeping the first non-null value of every other key, else it starts a
    new entry.
    """

    role: str | None = Field(None, description='The message role ("assistant"), once.')
    content: str | None = Field(None, description="Text to append to the message content.")
    refusal: str | None = Field(
        None, description="Text to append to the message's refusal (the model declined)."
    )
    reasoning_details: list[ReasoningDetail] | None = Field(
        None,
        description="Reasoning fragments to merge into the reasoning entries; each carries "
        "its entry's other keys (type, index, signature, ...).",
    )
    tool_calls: list[ToolCallFragment] | None = Field(
        None, description="Tool-call fragments to merge by index."
    )


class OtherChoiceDeltaData(ChoiceDeltaData):
    """What a choice other than 0 added (n > 1)."""

    index: int = Field(ge=1, description="The choice (choices[].index upstream).")


class DeltaData(ChoiceDeltaData):
    """``data`` of a ``delta`` entry: everything that arrived since the previous delta entry:
    choice 0's output at the top level, the other choices' (n > 1) under ``choices``."""

    choices: list[OtherChoiceDeltaData] | None = Field(
        None, description="n > 1: what the other choices added, by index."
    )


class Served(_Data):
    """Where an attempt's request went: its upstream and the model it asked for there, and
    the route that chose them (docs/routing.md)."""

    upstream: str = Field(description="The upstream's name.")
    model: str | None = Field(None, description="The model sent to it (its request's model).")
    route: str | None = Field(None, description="The route the target belongs to, if any.")


class FailedTarget(Served):
    """The target an attempt failed on, and how."""

    error: str = Field("", description="Its failure, in words.")


class ResetData(_Data):
    """``data`` of a ``reset`` entry: a new attempt starts; earlier deltas are void."""

    reason: str = Field(description="A human-readable reason.")
    after: FailedTarget | None = Field(
        None,
        description="The target the attempt before it failed on, after its output had begun "
        "(a retry after output, on a route the next target).",
    )


class WaitingData(_Data):
    """``data`` of a ``waiting`` entry: the attempt waits before it calls its upstream.

    Written once when the wait begins, then again only when its reason changes or after a
    pause that grows from 5 s to 60 s (at most 30 per attempt). Progress only: it changes
    nothing in the job's output, and a reader that does not know the type skips it.
    """

    reason: str = Field(
        description="upstream_down (the upstream, or with `model` that target, failed before "
        "its first byte: refused, timed out, 429 or 5xx; one probe at a time tries it), "
        "rate_limit (the upstream's requests per minute, fleet-wide, are used up) or "
        "targets_unavailable (no target of its `route` can take it now: each down or at its "
        "limits)."
    )
    upstream: str | None = Field(None, description="The upstream name the job waits for.")
    model: str | None = Field(None, description="With upstream_down: the target's model.")
    route: str | None = Field(None, description="With targets_unavailable: the route.")
    since_ms: int = Field(description="When the wait began, Unix milliseconds (worker's clock).")
    for_s: float = Field(description="Seconds it had waited when the entry was written.")
    retry_in_s: float | None = Field(
        None, description="Seconds until the upstream's next try, when known."
    )
    detail: str = Field("", description="Why, in words: the upstream's last failure.")


class ErrorObject(_Data):
    """The error of a failed job (the same object as the record's ``error`` field)."""

    code: str = Field(
        description="Machine-readable code, e.g. upstream_terminal, upstream_retryable, "
        "upstream_timeout, truncated, upstream_stream_error, protocol, event_too_large, "
        "invalid_job, unknown_upstream, attempts_exhausted."
    )
    message: str = Field(description="Human-readable message (never contains secrets).")
    status: int | None = Field(None, description="The upstream HTTP status, when there was one.")
    detail: Any = Field(
        None, description="The upstream's error object (or a snippet of its body), when known."
    )


class ChoiceFinish(_Data):
    """How a choice other than 0 ended (n > 1)."""

    index: int = Field(ge=1, description="The choice.")
    finish_reason: str | None = Field(description="Its finish_reason.")


class _Extras(_Data):
    """What a terminal entry carries besides its type's fields, when the upstream sent it
    (and, from a traced worker, its span's context)."""

    web_search: Any = Field(None, description="Provider extra (the last non-null value).")
    free_tier: Any = Field(None, description="Provider extra (the last non-null value).")
    traceparent: str | None = Field(
        None,
        description="W3C traceparent of the worker's span of the attempt, when the worker "
        "traces (OpenTelemetry): a consumer links its own span to it.",
    )


class _Finished(_Extras):
    choices: list[ChoiceFinish] | None = Field(
        None, description="n > 1: the other choices' finish_reason, by index."
    )
    served: Served | None = Field(
        None, description="Where the attempt that ended the job sent its request."
    )


class DoneData(_Finished):
    """``data`` of a ``done`` entry: the job succeeded."""

    finish_reason: str | None = Field(description="The upstream's finish_reason (choice 0).")
    usage: dict[str, Any] | None = Field(description="Token usage (the last non-null usage).")


class ErrorData(_Finished):
    """``data`` of an ``error`` entry: the job failed; deltas before it are the partial output."""

    error: ErrorObject
    finish_reason: str | None = Field(
        None, description="The upstream's finish_reason (choice 0), if it sent one."
    )
    usage: dict[str, Any] | None = Field(None, description="Token usage, if the upstream sent it.")


class CancelledData(_Finished):
    """``data`` of a ``cancelled`` entry: the job was cancelled."""

    usage: dict[str, Any] | None = Field(
        None, description="Token usage, absent when the job was cancelled before it ran."
    )


DATA_MODELS: dict[EventType, type[BaseModel]] = {
    EventType.DELTA: DeltaData,
    EventType.RESET: ResetData,
    EventType.DONE: DoneData,
    EventType.ERROR: ErrorData,
    EventType.CANCELLED: CancelledData,
    EventType.WAITING: WaitingData,
}


class StreamEvent(BaseModel):
    """One entry of ``<prefix>:job:{<id>}:events``.

    ``id`` is the stream entry id: the resume cursor. ``data`` depends on ``type``:
    delta: ``{role?, content?, refusal?, reasoning_details?, tool_calls?, choices?}`` (what
    arrived since the previous delta entry; tool-call fragments carry their ``index``;
    ``choices``: the other choices' with their ``index``, n > 1); reset: ``{reason, after?}``;
    done: ``{finish_reason, usage}``; error: ``{error, finish_reason?, usage?}``;
    cancelled: ``{usage?}``; waiting: ``{reason, upstream? model? route?, since_ms, for_s,
    retry_in_s?, detail}`` (progress only, never output); a terminal entry adds ``served``
    (the attempt's upstream, model and route) once the job ran, ``web_search`` /
    ``free_tier`` when the upstream sent them, ``traceparent`` when the worker traces and, n > 1,
    ``choices: [{index, finish_reason}]``. See
    ``DATA_MODELS`` for each type's model.
    """

    id: str = Field(description="The stream entry id, e.g. 1718000000000-0: the resume cursor.")
    type: EventType = Field(description="delta | reset | done | error | cancelled | waiting.")
    attempt: int = Field(
        ge=0,
        description="The attempt that wrote the entry (1, 2, ...; 0 only on the cancelled "
        "entry of a job cancelled before any attempt started).",
    )
    data: dict[str, Any] = Field(
        default_factory=dict, description="The type's data object (see DATA_MODELS)."
    )

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    @classmethod
    def from_entry(cls, entry_id: str, fields: dict[str, str]) -> StreamEvent:
        return cls(
            id=entry_id,
            type=EventType(fields["type"]),
            attempt=int(fields["attempt"]),
            data=json.loads(fields.get("data") or "{}"),
        )

    def parsed_data(self) -> BaseModel:
        """``data`` validated as this type's model (``DeltaData``, ``DoneData``, ...)."""
        return DATA_MODELS[self.type].model_validate(self.data)
