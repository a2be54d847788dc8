"""Job events as the Responses API's typed stream events and Response objects. Pure.

``ResponseEvents`` folds one job's events stream (docs/events.md), entry by entry, into the
events OpenAI's Responses API streams, numbered by ``sequence_number`` from 0. The numbers
are a function of the entries alone (never of timing or of how the entries were read), so
every gateway process gives every entry the same numbers, and a client resumes after any
number by folding the stream again from its start.

=========== ===================================================================================
start       ``response.created``, ``response.in_progress`` (before any entry)
``delta``   its ``reasoning_details``, then ``content``, ``refusal``, then ``tool_calls``:
            reasoning opens a ``reasoning`` item (``reasoning.text`` as ``reasoning_text``
            content, ``reasoning.summary`` as a ``summary_text`` part, ``reasoning.encrypted``
            as ``encrypted_content``), text and refusals a ``message`` item (an
            ``output_text`` or ``refusal`` part each), each tool call (by index) a
            ``function_call`` item whose arguments stream as ``function_call_arguments.delta``.
            A message or reasoning item ends when output of another kind comes; a function
            call at the end of the response (providers may interleave calls)
``reset``   every open item ends ``incomplete``; the items so far leave the response's
            ``output``; ``response.in_progress`` again, with ``"chatstream": {"reset": ...}``;
            the next attempt's items continue the ``output_index`` count
``done``    open items end, then ``response.completed``; ``incomplete`` (items and response,
            ``incomplete_details.reason``) when the finish reason was ``length``
            (``max_output_tokens``) or ``content_filter``
``error``   open items end ``incomplete``, then ``response.failed`` with ``error.code`` from
            the API's list and ``error.chatstream.code`` = the job's own code
``cancelled`` open items end ``incomplete``, then ``response.incomplete`` with status
            ``cancelled`` (the API has no ``response.cancelled`` event)
=========== ===================================================================================

``ResponseEvents.response()`` is the Response object at that point: what ``GET
/v1/responses/{id}`` answers and what the lifecycle events carry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.gateway.openai_format import PASSED_ON, json_object

Event = dict[str, Any]
ItemT = TypeVar("ItemT", bound="Item")
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
# a finish reason that makes the response incomplete -> incomplete_details.reason
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


@dataclass(frozen=True)
class ResponseContext:
    """What every Response object of one job repeats: ids, creation time, the request."""

    job_id: str
    created: int
    echo: Mapping[str, Any]

    @property
    def response_id(self) -> str:
        return response_id(self.job_id)

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            **self.echo,
            "error": None,
            "incomplete_details": None,
            "output": output,
            "usage": None,
            **fields,
        }


def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def job_id_of(response_id: str) -> str | None:
    """The job of a response id (``resp_<job id>``), None when it is not one."""
    prefix, _, job_id = response_id.partition("_")
    return job_id if prefix == "resp" and job_id else None


def event(kind: str, **fields: Any) -> Event:
    return {"type": kind, **fields}


# -- content parts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartKind:
    """The events of one kind of part: added, delta..., done, part done."""

    part_type: str
    text_key: str
    index_key: str
    added: str
    delta: str
    done: str
    part_done: str
    text_extra: Mapping[str, Any]
    part_extra: Mapping[str, Any]


OUTPUT_TEXT = PartKind(
    "output_text", "text", "content_index", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.content_part.done",
    {"logprobs": []}, {"annotations": [], "logprobs": []},
)  # fmt: skip
REFUSAL = PartKind(
    "refusal", "refusal", "content_index", "response.content_part.added",
    "response.refusal.delta", "response.refusal.done", "response.content_part.done", {}, {},
)  # fmt: skip
REASONING_TEXT = PartKind(
    "reasoning_text", "text", "content_index", "response.content_part.added",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.content_part.done", {}, {},
)  # fmt: skip
SUMMARY_TEXT = PartKind(
    "summary_text", "text", "summary_index", "response.reasoning_summary_part.added",
    "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done", {}, {},
)  # fmt: skip


class Part:
    """One content (or summary) part of an item, its text so far."""

    def __init__(self, kind: PartKind, item: Item, index: int) -> None:
        self.kind = kind
        self.where = {"item_id": item.id, "output_index": item.index, kind.index_key: index}
        self.text = ""

    def view(self) -> dict[str, Any]:
        return {"type": self.kind.part_type, self.kind.text_key: self.text, **self.kind.part_extra}

    def added(self) -> list[Event]:
        return [event(self.kind.added, **self.where, part=self.view())]

    def append(self, text: str) -> list[Event]:
        self.text += text
        return [event(self.kind.delta, **self.where, delta=text, **self.kind.text_extra)]

    def done(self) -> list[Event]:
        kind = self.kind
        return [
            event(kind.done, **self.where, **{kind.text_key: self.text}, **kind.text_extra),
            event(kind.part_done, **self.where, part=self.view()),
        ]


# -- output items -------------------------------------------------------------------------------


class Item:
    """One output item: ``added()`` opens it, ``close(status)`` ends it."""

    prefix = "item"

    def __init__(self, index: int, job_id: str) -> None:
        self.index = index
        self.id = f"{self.prefix}_{job_id}_{index}"
        self.status = "in_progress"

    @property
    def open(self) -> bool:
        return self.status == "in_progress"

    def view(self) -> dict[str, Any]:
        raise NotImplementedError

    def added(self) -> list[Event]:
        return [event("response.output_item.added", output_index=self.index, item=self.view())]

    def close(self, status: str) -> list[Event]:
        events = self.finish()
        self.status = status
        events.append(event("response.output_item.done", output_index=self.index, item=self.view()))
        return events

    def finish(self) -> list[Event]:
        """The events that end the item's parts."""
        return []


class MessageItem(Item):
    prefix = "msg"

    def __init__(self, index: int, job_id: str) -> None:
        super().__init__(index, job_id)
        self.parts: list[Part] = []
        self.part_open = False

    def view(self) -> dict[str, Any]:
        content = [part.view() for part in self.parts]
        return {"id": self.id, "type": "message", "status": self.status, "content": content,
                "role": "assistant"}  # fmt: skip

    def write(self, kind: PartKind, text: str) -> list[Event]:
        events: list[Event] = []
        if not (self.part_open and self.parts[-1].kind is kind):
            events = self.finish()
            self.parts.append(Part(kind, self, len(self.parts)))
            self.part_open = True
            events += self.parts[-1].added()
        return events + self.parts[-1].append(text)

    def finish(self) -> list[Event]:
        if not self.part_open:
            return []
        self.part_open = False
        return self.parts[-1].done()


class ReasoningItem(Item):
    prefix = "rs"

    def __init__(self, index: int, job_id: str) -> None:
        super().__init__(index, job_id)
        self.text: Part | None = None
        self.summary: Part | None = None
        self.encrypted = ""

    @staticmethod
    def carries(fragment: dict[str, Any]) -> bool:
        """Whether a ``reasoning_details`` fragment has anything a reasoning item shows."""
        key = FRAGMENT_KEYS.get(text_of(fragment.get("type")))
        return key is not None and isinstance(fragment.get(key), str) and bool(fragment[key])

    def view(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": self.id,
            "type": "reasoning",
            "status": self.status,
            "summary": [self.summary.view()] if self.summary else [],
            "content": [self.text.view()] if self.text else [],
        }
        if self.encrypted:
            item["encrypted_content"] = self.encrypted
        return item

    def write(self, fragment: dict[str, Any]) -> list[Event]:
        kind = fragment.get("type")
        if kind == "reasoning.encrypted":
            self.encrypted += fragment["data"]
            return []
        slot = "text" if kind == "reasoning.text" else "summary"
        part: Part | None = getattr(self, slot)
        events: list[Event] = []
        if part is None:
            part = Part(REASONING_TEXT if slot == "text" else SUMMARY_TEXT, self, 0)
            setattr(self, slot, part)
            events = part.added()
        return events + part.append(fragment[FRAGMENT_KEYS[str(kind)]])

    def finish(self) -> list[Event]:
        return [event for part in (self.text, self.summary) if part for event in part.done()]


# the key of a reasoning fragment that holds what it adds, by fragment type
FRAGMENT_KEYS = {"reasoning.text": "text", "reasoning.summary": "summary",
                 "reasoning.encrypted": "data"}  # fmt: skip


class FunctionCallItem(Item):
    prefix = "fc"

    def __init__(self, index: int, job_id: str, fragment: dict[str, Any]) -> None:
        super().__init__(index, job_id)
        call_id = fragment.get("id")
        self.call_id = call_id if isinstance(call_id, str) and call_id else f"call_{self.id}"
        self.name = _function_name(fragment)  # in output_item.added, as OpenAI sends it
        self.arguments = ""

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "arguments": self.arguments,
            "call_id": self.call_id,
            "name": self.name,
        }

    def write(self, fragment: dict[str, Any]) -> list[Event]:
        function = fragment.get("function")
        arguments = function.get("arguments") if isinstance(function, dict) else None
        self.name = self.name or _function_name(fragment)  # the first non-empty one counts
        if not isinstance(arguments, str) or not arguments:
            return []
        self.arguments += arguments
        delta = {"item_id": self.id, "output_index": self.index, "delta": arguments}
        return [event("response.function_call_arguments.delta", **delta)]

    def finish(self) -> list[Event]:
        done = {"item_id": self.id, "output_index": self.index, "arguments": self.arguments}
        return [event("response.function_call_arguments.done", **done)]


def _function_name(fragment: dict[str, Any]) -> str:
    function = fragment.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""


# -- the fold -----------------------------------------------------------------------------------


class ResponseEvents:
    """One job's entries, in order, as Responses events numbered from 0 (see the module)."""

    def __init__(self, ctx: ResponseContext) -> None:
        self.ctx = ctx
        self.sequence = 0
        self.output_count = 0
        self.items: list[Item] = []  # the current attempt's, in output order
        self.current: MessageItem | ReasoningItem | None = None
        self.calls: dict[int, FunctionCallItem] = {}
        self.outcome: dict[str, Any] | None = None  # the response's last fields, once ended
        self.failure: dict[str, Any] | None = None  # the job's own error, when it failed
        self._handlers: dict[str, Callable[[dict[str, Any], str], list[Event]]] = {
            "delta": self._delta,
            "reset": self._reset,
            "done": self._done,
            "error": self._error,
            "cancelled": self._cancelled,
        }

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def response(self, status: str = "in_progress") -> dict[str, Any]:
        """The Response object now (``status`` until the job ended, then the outcome's)."""
        fields = dict(self.outcome or {"status": status})
        status = fields.pop("status")
        return self.ctx.response(status, [item.view() for item in self.items], **fields)

    def opening(self) -> list[Event]:
        response = self.response()
        created = event("response.created", response=response)
        return self._numbered([created, event("response.in_progress", response=response)])

    def feed(self, entry_id: str, fields: Mapping[str, str]) -> list[Event]:
        """The events of one entry of the job's stream (nothing after the terminal one)."""
        handler = self._handlers.get(fields.get("type", ""))
        if handler is None or self.ended:
            return []
        return self._numbered(handler(json_object(fields.get("data")), entry_id))

    def expired(self, message: str) -> Event:
        """The stream-level error event for a job whose record expired while it was read."""
        error = event("error", code="job_expired", message=message, param=None)
        return self._numbered([error])[0]

    def _numbered(self, events: list[Event]) -> list[Event]:
        for item in events:
            item["sequence_number"] = self.sequence
            self.sequence += 1
        return events

    # -- entries --

    def _delta(self, data: dict[str, Any], entry_id: str) -> list[Event]:
        events: list[Event] = []
        for fragment in fragments(data.get("reasoning_details")):
            if ReasoningItem.carries(fragment):
                events += self._reasoning(fragment)
        for kind, key in ((OUTPUT_TEXT, "content"), (REFUSAL, "refusal")):
            text = data.get(key)
            if isinstance(text, str) and text:
                events += self._message(kind, text)
        for fragment in fragments(data.get("tool_calls")):
            events += self._tool_call(fragment)
        return events

    def _reasoning(self, fragment: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self.current, ReasoningItem):
            events = self._close_current()
            self.current = self._open(ReasoningItem(self.output_count, self.ctx.job_id), events)
        return events + self.current.write(fragment)

    def _message(self, kind: PartKind, text: str) -> list[Event]:
        events: list[Event] = []
        if not isinstance(self.current, MessageItem):
            events = self._close_current()
            self.current = self._open(MessageItem(self.output_count, self.ctx.job_id), events)
        return events + self.current.write(kind, text)

    def _tool_call(self, fragment: dict[str, Any]) -> list[Event]:
        index = fragment.get("index")
        if type(index) is not int:
            return []
        events: list[Event] = []
        call = self.calls.get(index)
        if call is None:
            events = self._close_current()
            call = FunctionCallItem(self.output_count, self.ctx.job_id, fragment)
            self.calls[index] = self._open(call, events)
        return events + call.write(fragment)

    def _reset(self, data: dict[str, Any], entry_id: str) -> list[Event]:
        events = self._close_all("incomplete")
        self.items = []
        events.append(
            event("response.in_progress", response=self.response(), chatstream={"reset": data})
        )
        return events

    def _done(self, data: dict[str, Any], entry_id: str) -> list[Event]:
        reason = INCOMPLETE.get(text_of(data.get("finish_reason")))
        status = "incomplete" if reason else "completed"
        events = self._close_all(status)
        self.outcome = {"status": status, "usage": responses_usage(data.get("usage"))}
        if reason:
            self.outcome["incomplete_details"] = {"reason": reason}
        else:
            self.outcome["completed_at"] = entry_seconds(entry_id)
        return [*events, event(f"response.{status}", response=self.response())]

    def _error(self, data: dict[str, Any], entry_id: str) -> list[Event]:
        events = self._close_all("incomplete")
        failure = data.get("error")
        self.failure = failure if isinstance(failure, dict) else {}
        usage = responses_usage(data.get("usage"))
        self.outcome = {"status": "failed", "error": response_error(self.failure), "usage": usage}
        return [*events, event("response.failed", response=self.response())]

    def _cancelled(self, data: dict[str, Any], entry_id: str) -> list[Event]:
        events = self._close_all("incomplete")
        self.outcome = {"status": "cancelled", "usage": responses_usage(data.get("usage"))}
        return [*events, event("response.incomplete", response=self.response())]

    # -- items --

    def _open(self, item: ItemT, events: list[Event]) -> ItemT:
        self.output_count += 1
        self.items.append(item)
        events += item.added()
        return item

    def _close_current(self) -> list[Event]:
        current, self.current = self.current, None
        return current.close("completed") if current is not None else []

    def _close_all(self, status: str) -> list[Event]:
        events = [event for item in self.items if item.open for event in item.close(status)]
        self.current, self.calls = None, {}
        return events


# -- values -------------------------------------------------------------------------------------


def text_of(value: Any) -> str:
    return value if isinstance(value, str) else ""


def fragments(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def entry_seconds(entry_id: str) -> int | None:
    """When an entry was written (its id is the Redis server's clock in ms)."""
    ms = entry_id.partition("-")[0]
    return int(ms) // 1000 if ms.isdigit() else None


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def responses_usage(usage: Any) -> dict[str, Any] | None:
    """A chat ``usage`` object in the Responses API's shape (None when there is none)."""
    if not isinstance(usage, dict):
        return None
    inputs, outputs = usage.get("prompt_tokens_details"), usage.get("completion_tokens_details")
    inputs = inputs if isinstance(inputs, dict) else {}
    outputs = outputs if isinstance(outputs, dict) else {}
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": _count(inputs.get("cached_tokens")),
            "cache_write_tokens": _count(inputs.get("cache_write_tokens")),
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": _count(outputs.get("reasoning_tokens"))},
        "total_tokens": _count(usage.get("total_tokens")) or prompt + completion,
    }


def response_error(error: Mapping[str, Any]) -> dict[str, Any]:
    """A job's error as a Response's ``error``: a code from the API's list, the job's own
    code in ``chatstream.code``."""
    return {
        "code": responses_error_code(error),
        "message": str(error.get("message") or "the response failed"),
        "chatstream": {"code": str(error.get("code") or "error")},
    }


def responses_error_code(error: Mapping[str, Any]) -> str:
    code, status = error.get("code"), error.get("status")
    if status == 429:
        return "rate_limit_exceeded"
    if code == "invalid_job" or (code == "upstream_terminal" and status in PASSED_ON):
        return "invalid_prompt"
    return "server_error"


def sse_frames(events: Iterable[Event], after: int = -1) -> bytes:
    """The SSE bytes of the events numbered above ``after`` (OpenAI writes ``event:`` too)."""
    return b"".join(
        b"event: %s\ndata: %s\n\n" % (item["type"].encode(), _dumps(item).encode())
        for item in events
        if item["sequence_number"] > after
    )
