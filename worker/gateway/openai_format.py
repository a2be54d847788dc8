"""Job events and records in OpenAI's chat-completions format. Pure: dicts in, bytes out.

A job's events stream (docs/events.md) becomes the SSE body OpenAI sends for
``"stream": true``: ``chat.completion.chunk`` objects, the usage chunk when the request
asked for it, ``data: [DONE]``. Each Redis entry is one SSE event (or, for the terminal
entry, a few events written together); the last carries ``id: <entry id>``, the resume
cursor, so a client cut off between a terminal entry's events gets them all again (a
finish chunk twice, never a token twice) rather than losing its usage chunk and
``[DONE]``. The mapping, entry by entry:

=========== =============================================================================
``delta``   one chunk: the top-level keys are ``choices[0].delta``, each entry of the
            delta's ``choices`` (n > 1) is ``choices[i].delta`` of its ``index``; each key
            maps through ``DELTA_FIELDS`` (unlisted keys pass through unchanged)
``reset``   a chunk with ``choices: []`` and ``"chatstream": {"reset": {...}}``: the
            reply starts over; text shown so far is void (OpenAI has no such event)
``done``    the finish chunk (every choice's ``finish_reason``, plus ``TERMINAL_EXTRAS``),
            the usage chunk (when asked for and known), ``data: [DONE]``
``error``   OpenAI's mid-stream error: a chunk with a top-level ``error`` object (and
            ``TERMINAL_EXTRAS``) and ``finish_reason: "error"`` for every choice; no
            ``[DONE]``
``cancelled`` the same error chunk with the code ``cancelled``
``waiting`` an SSE comment line ``: waiting {...}`` (the entry's data; no event, no id):
            SDKs skip it, a raw reader shows it; any other type is skipped the same way.
            With ``progress_events`` (``?progress=events``, the page): ``event: waiting``
=========== =============================================================================

One entry is one chunk however many choices it carries (OpenAI's ``choices`` may hold
several with n > 1), so an entry's id resumes after all of it.

``completion()`` turns a finished record into a ``chat.completion`` object, and
``job_error_status()`` gives the HTTP status a failed job is answered with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from schemas.jobs import EXTRAS, JobRecord

Row = tuple[str, dict[str, str]]  # a stream entry as XRANGE / XREAD return it
DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


# -- delta fields: each key of a delta entry maps to the OpenAI delta in exactly one place --


def _same(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


def _tool_calls(fragments: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's first fragment of a call carries ``arguments: ""``; SDKs rely on the key."""
    return {"tool_calls": [_with_arguments(fragment) for fragment in fragments]}


def _with_arguments(fragment: dict[str, Any]) -> dict[str, Any]:
    function = fragment.get("function")
    if isinstance(function, dict) and "name" in function and "arguments" not in function:
        return {**fragment, "function": {**function, "arguments": ""}}
    return fragment


DELTA_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "role": _same("role"),
    "content": _same("content"),
    "refusal": _same("refusal"),
    "reasoning_details": _same("reasoning_details"),
    "tool_calls": _tool_calls,
}
# What structures a delta entry rather than being a field of a choice's delta: the other
# choices (n > 1) and, inside each of them, its index.
CHOICE_KEYS = frozenset({"choices", "index"})
# The terminal entry's keys copied to the top level of its chunk (and of a chat.completion
# from the record's fields of the same names).
TERMINAL_EXTRAS: tuple[str, ...] = EXTRAS


def json_object(raw: str | None) -> dict[str, Any]:
    """A JSON object from Redis (an entry's ``data``, a record field); {} for anything else."""
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def openai_delta(data: dict[str, Any]) -> dict[str, Any]:
    """One choice's fields of a delta entry as OpenAI's ``delta``."""
    delta: dict[str, Any] = {}
    for name, value in data.items():
        if name not in CHOICE_KEYS:
            delta.update(DELTA_FIELDS.get(name, _same(name))(value))
    return delta


def delta_choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A delta entry's chunk choices: choice 0 (the top level) when it added anything,
    then the other choices in the order the entry has them (by index)."""
    others: list[dict[str, Any]] = data.get("choices") or []
    first = openai_delta(data)
    choices = [_choice(0, first, None)] if first or not others else []
    choices.extend(_choice(other["index"], openai_delta(other), None) for other in others)
    return choices


def choice_indexes(data: dict[str, Any]) -> list[int]:
    """The choices a terminal entry speaks of: 0, and the others' (n > 1)."""
    return [0, *(other["index"] for other in data.get("choices") or [])]


def terminal_extras(data: dict[str, Any]) -> dict[str, Any]:
    return {name: data[name] for name in TERMINAL_EXTRAS if data.get(name) is not None}


# -- chunks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkContext:
    """What every chunk of one job's stream repeats."""

    job_id: str
    created: int
    model: str
    include_usage: bool
    progress_events: bool = False  # waiting entries as ``event: waiting`` (?progress=events)

    @property
    def completion_id(self) -> str:
        return f"chatcmpl-{self.job_id}"

    def chunk(self, choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **top,
        }


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish_reason}


def entry_payloads(ctx: ChunkContext, kind: str, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunk objects of one entry; a ``done`` entry is followed by ``[DONE]`` (not here)."""
    if kind == "delta":
        return [ctx.chunk(delta_choices(data))]
    if kind == "reset":
        return [ctx.chunk([], chatstream={"reset": data})]
    if kind == "done":
        return _done_chunks(ctx, data)
    error = data.get("error") if kind == "error" else CANCELLED_ERROR
    top: dict[str, Any] = {"error": openai_error_object(error), **terminal_extras(data)}
    if data.get("usage") is not None:
        top["usage"] = data["usage"]
    return [ctx.chunk([_choice(i, {}, "error") for i in choice_indexes(data)], **top)]


def _done_chunks(ctx: ChunkContext, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The finish chunk (every choice's finish_reason, the extras), then the usage chunk."""
    others = data.get("choices") or []
    finish = [_choice(0, {}, data.get("finish_reason"))]
    finish.extend(_choice(other["index"], {}, other.get("finish_reason")) for other in others)
    chunks = [ctx.chunk(finish, **terminal_extras(data))]
    if ctx.include_usage and data.get("usage") is not None:
        chunks.append(ctx.chunk([], usage=data["usage"]))
    return chunks


CANCELLED_ERROR = {"code": "cancelled", "message": "the job was cancelled"}


def sse_frames(ctx: ChunkContext, rows: Iterable[Row]) -> bytes:
    """The SSE bytes of these entries, in OpenAI's format."""
    out: list[bytes] = []
    for entry_id, fields in rows:
        kind = fields.get("type", "")
        if kind not in OUTPUT_TYPES:  # progress (waiting): a comment, invisible to SDKs
            out.append(progress_frame(kind, fields.get("data") or "{}", ctx.progress_events))
            continue
        payloads = entry_payloads(ctx, kind, json.loads(fields.get("data") or "{}"))
        frames = [b"data: " + _dumps(payload).encode() + b"\n\n" for payload in payloads]
        if kind == "done":
            frames.append(DONE_FRAME)
        # the entry's id rides on its last event: a client cut off inside an entry's events
        # resumes before the entry and gets all of them again (none lost)
        out.extend(frames[:-1])
        out.append(b"id: " + entry_id.encode() + b"\n" + (frames[-1] if frames else b"\n"))
    return b"".join(out)


OUTPUT_TYPES = frozenset({"delta", "reset", "done", "error", "cancelled"})


def progress_frame(kind: str, data: str, as_event: bool) -> bytes:
    """``: waiting {...}`` with no blank line after it: a comment line joins the next event
    (an SDK that keeps the last ``id`` would read an empty event after a blank line). Asked
    for (the page), a named event without an id: ``event: waiting`` + ``data: {...}``."""
    name, line = kind.encode()[:40], data.replace("\n", " ").encode()
    if as_event:
        return b"event: " + name + b"\ndata: " + line + b"\n\n"
    return b": " + name + b" " + line + b"\n"


def native_frames(rows: Iterable[Row]) -> bytes:
    """The SSE bytes of these entries as chatstream events (``?format=chatstream``):
    ``{"id", "type", "attempt", "data"}``, as ``chatstream tail --json`` prints them."""
    out: list[bytes] = []
    for entry_id, fields in rows:
        event = (
            f'{{"id":{_dumps(entry_id)},"type":{_dumps(fields.get("type", ""))},'
            f'"attempt":{int(fields.get("attempt") or 0)},"data":{fields.get("data") or "{}"}}}'
        )
        out.append(f"id: {entry_id}\ndata: {event}\n\n".encode())
    return b"".join(out)


def error_frame(ctx: ChunkContext, code: str, message: str) -> bytes:
    """A mid-stream error chunk that is not an entry of the stream (the job expired)."""
    chunk = ctx.chunk(
        [_choice(0, {}, "error")], error=openai_error_object({"code": code, "message": message})
    )
    return b"data: " + _dumps(chunk).encode() + b"\n\n"


# -- errors -------------------------------------------------------------------------------

# a job's error code -> (HTTP status, OpenAI error type) when the job is answered over HTTP
JOB_ERRORS: dict[str, tuple[int, str]] = {
    "invalid_job": (400, "invalid_request_error"),
    "unknown_upstream": (400, "invalid_request_error"),
    "upstream_timeout": (504, "timeout_error"),
    "cancelled": (409, "cancelled"),
}
# upstream statuses that say the request itself was refused: passed on as they are
PASSED_ON = frozenset({400, 404, 413, 422})


def job_error_status(error: dict[str, Any]) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of a job that ended with ``error``."""
    code = str(error.get("code", ""))
    if code == "upstream_terminal" and error.get("status") in PASSED_ON:
        return int(error["status"]), "invalid_request_error"
    return JOB_ERRORS.get(code, (502, "upstream_error"))


def openai_error_object(error: dict[str, Any] | None) -> dict[str, Any]:
    """A chatstream error ``{code, message, status?, detail?}`` as OpenAI's error object."""
    error = error or {"code": "error", "message": "the job failed"}
    return {
        "message": str(error.get("message", "")),
        "type": job_error_status(error)[1],
        "param": None,
        "code": error.get("code"),
    }


# -- the non-streaming response -------------------------------------------------------------


def completion(ctx: ChunkContext, record: JobRecord) -> dict[str, Any]:
    """A succeeded job's record as a ``chat.completion`` object: choice 0 from the record's
    top-level fields, the others (n > 1) from its ``choices``."""
    first = {"index": 0, **record.model_dump(include=set(CHOICE_OUTPUT))}
    body: dict[str, Any] = {
        "id": ctx.completion_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": record.model or ctx.model,
        "choices": [_completion_choice(output) for output in (first, *record.choices)],
        "usage": record.usage,
    }
    extras = record.model_dump(include=set(TERMINAL_EXTRAS))
    body.update(terminal_extras(extras))
    return body


# a choice's output in the record (choice 0's at the top level, the others' in ``choices``)
CHOICE_OUTPUT = ("content", "refusal", "reasoning", "tool_calls", "finish_reason")


def _completion_choice(output: dict[str, Any]) -> dict[str, Any]:
    """One choice of a ``chat.completion``: its ``message`` as OpenAI writes it (``content``
    null when the choice called tools or refused, ``refusal`` null unless it refused)."""
    content, refusal = output.get("content") or "", output.get("refusal") or ""
    calls = output.get("tool_calls") or []
    message: dict[str, Any] = {
        "role": output.get("role") or "assistant",
        "content": content or (None if calls or refusal else ""),
        "refusal": refusal or None,
    }
    if calls:
        message["tool_calls"] = calls
    if output.get("reasoning"):
        message["reasoning_details"] = output["reasoning"]
    return {"index": output["index"], "message": message, "finish_reason": output["finish_reason"]}
