"""Job events and records in OpenAI's chat-completions format. Pure: dicts in, bytes out.

A job's events stream (docs/events.md) becomes the SSE body OpenAI sends for
``"stream": true``: ``chat.completion.chunk`` objects, the usage chunk when the request
asked for it, ``data: [DONE]``. Each Redis entry is one SSE event (or, for the terminal
entry, a few events written together); the first carries ``id: <entry id>``, the resume
cursor. The mapping, entry by entry:

=========== =============================================================================
``delta``   one chunk; each delta key maps to the chunk's ``choices[i].delta`` through
            ``DELTA_FIELDS`` (unlisted keys pass through unchanged)
``reset``   a chunk with ``choices: []`` and ``"chatstream": {"reset": {...}}``: the
            reply starts over; text shown so far is void (OpenAI has no such event)
``done``    the finish chunk (``finish_reason``, plus ``TERMINAL_EXTRAS``), the usage
            chunk (when asked for and known), ``data: [DONE]``
``error``   OpenAI's mid-stream error: a chunk with a top-level ``error`` object and
            ``finish_reason: "error"``; no ``[DONE]``
``cancelled`` the same error chunk with the code ``cancelled``
=========== =============================================================================

``completion()`` turns a finished record into a ``chat.completion`` object, and
``job_error_status()`` gives the HTTP status a failed job is answered with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from schemas.jobs import JobRecord

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
    "reasoning_details": _same("reasoning_details"),
    "tool_calls": _tool_calls,
}
# The terminal entry's keys copied to the top level of the finish chunk (and of a
# chat.completion from the record's fields of the same names).
TERMINAL_EXTRAS: tuple[str, ...] = ("web_search", "free_tier")


def choice_index(data: dict[str, Any]) -> int:
    """The choice a delta belongs to. Deltas are of choice 0 today (n = 1)."""
    return 0


def openai_delta(data: dict[str, Any]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    for name, value in data.items():
        delta.update(DELTA_FIELDS.get(name, _same(name))(value))
    return delta


# -- chunks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkContext:
    """What every chunk of one job's stream repeats."""

    job_id: str
    created: int
    model: str
    include_usage: bool

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
        return [ctx.chunk([_choice(choice_index(data), openai_delta(data), None)])]
    if kind == "reset":
        return [ctx.chunk([], chatstream={"reset": data})]
    if kind == "done":
        extras = {name: data[name] for name in TERMINAL_EXTRAS if data.get(name) is not None}
        chunks = [ctx.chunk([_choice(0, {}, data.get("finish_reason"))], **extras)]
        if ctx.include_usage and data.get("usage") is not None:
            chunks.append(ctx.chunk([], usage=data["usage"]))
        return chunks
    error = data.get("error") if kind == "error" else CANCELLED_ERROR
    top: dict[str, Any] = {"error": openai_error_object(error)}
    if data.get("usage") is not None:
        top["usage"] = data["usage"]
    return [ctx.chunk([_choice(0, {}, "error")], **top)]


CANCELLED_ERROR = {"code": "cancelled", "message": "the job was cancelled"}


def sse_frames(ctx: ChunkContext, rows: Iterable[Row]) -> bytes:
    """The SSE bytes of these entries, in OpenAI's format."""
    out: list[bytes] = []
    for entry_id, fields in rows:
        kind = fields.get("type", "")
        payloads = entry_payloads(ctx, kind, json.loads(fields.get("data") or "{}"))
        out.append(b"id: " + entry_id.encode() + b"\n")
        out.extend(b"data: " + _dumps(payload).encode() + b"\n\n" for payload in payloads)
        if kind == "done":
            out.append(DONE_FRAME)
    return b"".join(out)


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
    """A succeeded job's record as a ``chat.completion`` object."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": record.content if record.content or not record.tool_calls else None,
    }
    if record.tool_calls:
        message["tool_calls"] = record.tool_calls
    if record.reasoning:
        message["reasoning_details"] = record.reasoning
    body: dict[str, Any] = {
        "id": ctx.completion_id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": record.model or ctx.model,
        "choices": [{"index": 0, "message": message, "finish_reason": record.finish_reason}],
        "usage": record.usage,
    }
    for name in TERMINAL_EXTRAS:
        if getattr(record, name, None) is not None:
            body[name] = getattr(record, name)
    return body
