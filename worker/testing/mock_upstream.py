"""An OpenAI-compatible fake streaming server for the demo, the tests and the benchmarks.

A pure ASGI app (no framework), served by uvicorn::

    mock = MockUpstream(MockConfig(tokens=50))
    async with serve_mock(app=mock) as base_url:      # "http://127.0.0.1:PORT/v1"
        ...  # POST {base_url}/chat/completions; mock.requests, mock.disconnects, ...

    async with serve_mock(tokens=50, rate=20.0) as base_url:  # MockConfig fields as kwargs
        ...

    run_mock("127.0.0.1", 8900, MockConfig())        # blocking; `chatstream mock-upstream`

Routes: ``POST /v1/chat/completions`` (SSE when ``"stream": true``, else one JSON
``chat.completion``) and ``GET /v1/models``. A stream is: deltas (``role`` once, on the
first delta), ``reasoning_details`` fragments, content tokens ``"tok0 tok1 ..."``, tool-call
fragments, a finish chunk, the usage chunk (``stream_options.include_usage``), ``[DONE]``.
The reply is deterministic: ``expected_reply(request, config)`` (and ``expected_reasoning``,
``expected_tool_calls``, ``expected_usage``) compute exactly what a request will receive.

Per-request behaviour: the body may carry ``"mock": {...}`` with any field of
``REQUEST_OPTIONS`` (the names of ``MockConfig``'s per-request fields), overriding the
server defaults. ``max_tokens`` below ``tokens`` cuts the reply with ``finish_reason
"length"``. Faults (``"fault"``), at ``fault_after`` tokens where they happen mid-stream:

    http_NNN            that HTTP status with an OpenAI-style JSON error (429: Retry-After)
    sse_NNN             the same error sent as LiteLLM streams it: that status, content-type
                        text/event-stream, ``data: {"error": {..., "code": "NNN"}}``
    midstream_error     an error chunk (top-level ``error``, finish_reason "error"), no [DONE];
                        its ``code`` is ``error_status`` (502 by default, a server_error)
    truncate            the body ends cleanly with neither finish_reason nor [DONE]
    disconnect          the connection is dropped mid-body
    json_200            HTTP 200 with an application/json error body
    context_length      HTTP 400: OpenAI's ``context_length_exceeded`` error
    wrong_content_type  HTTP 200 text/plain
    malformed_json      one ``data:`` line of broken JSON, then the stream goes on
    oversized_event     one content chunk of ``oversized_mb`` MiB of "x", then goes on
    stall               a pause of ``stall_seconds``, then the stream goes on
    drip                an event begun and never ended: one byte every ``drip_seconds``
                        until the client goes away
    no_first_byte       a pause of ``stall_seconds`` before the response headers
    keepalive           ``: keep-alive`` comments (every ``keepalive_every`` chunks, or 1)

``script: [data, ...]`` replaces the whole stream by those ``data:`` fields, sent as they
are (paced and batched like tokens; ``[DONE]`` only if the script has it): any chunk a
provider sends (``n > 1``, refusals, split surrogate pairs, extras) in a real stream.

``fail_times: N`` applies the fault only to the first N requests carrying the same
``key``; later ones succeed. ``rate`` paces tokens per second against the stream's start
(0 = as fast as possible, several events per write); ``tick`` (seconds) makes a paced
stream sleep at least that long between writes, coalescing the tokens due meanwhile (far
fewer writes for thousands of slow streams). ``timestamps: true`` makes every
content token the send time ``f"{time.time():.6f} "`` so consumers can measure latency.

A gateway's models (server-only): ``models`` maps a request's ``model`` to options of its own
(``{"bad-model": {"fault": "http_500"}}``), applied before the request's ``mock`` object, as
behind LiteLLM or OpenRouter one URL serves models that fail on their own.

Provider limits (server-only): ``max_concurrent`` answers 429 to a request that arrives
while that many are in progress, ``requests_per_minute`` to one beyond that many in the
last 60 s (as a provider counts, the rejected ones too); both with ``Retry-After``.

Observability on the app: ``requests`` (per path), ``key_requests`` (per ``mock.key``),
``model_requests`` (chat requests per request ``model``, rate-limited ones excepted),
``open_streams``, ``streams_started``, ``most_concurrent`` (the most requests in progress
at once), ``rate_limited`` (429s sent for the limits above; ``rate_limited_at``: when),
``disconnects`` ([(key, time.monotonic())] of clients that went away mid-response),
``disconnected`` (an ``asyncio.Event``), ``request_times`` (time.monotonic() of the latest
chat requests' arrivals), ``send_times`` (time.time() of each token chunk
when ``record_send_times``) and ``request_headers`` (the headers of the latest chat
requests, without authorization).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import time
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import uvicorn

from worker.embedded_server import EmbeddedServer, bind, served

__all__ = [
    "FAULTS",
    "REQUEST_OPTIONS",
    "MockConfig",
    "MockRequestError",
    "MockUpstream",
    "app_from_env",
    "check_fault",
    "expected_reasoning",
    "expected_reply",
    "expected_tool_calls",
    "expected_usage",
    "resolve_options",
    "run_mock",
    "serve_mock",
]

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MIDSTREAM_FAULTS = frozenset(
    {
        "midstream_error",
        "truncate",
        "disconnect",
        "malformed_json",
        "oversized_event",
        "stall",
        "drip",
    }
)
FAULTS = MIDSTREAM_FAULTS | {
    "json_200",
    "wrong_content_type",
    "no_first_byte",
    "keepalive",
    "context_length",
}
CONTEXT_LENGTH_ERROR = {  # OpenAI's answer to a prompt longer than the model's context
    "error": {
        "message": "This model's maximum context length is 8192 tokens. However, your "
        "messages resulted in 9000 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
_HTTP_FAULT = re.compile(r"(http|sse)_([45]\d\d)")
_REASONING_DEFAULT = 8  # fragments sent for "reasoning": true
_ARG_FRAGMENT = 8  # characters per tool-call arguments fragment
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


@dataclass(frozen=True)
class MockConfig:
    """Server defaults; the fields in ``REQUEST_OPTIONS`` can be overridden per request."""

    tokens: int = 16
    rate: float = 0.0
    tick: float = 0.0
    chunk_tokens: int = 1
    keepalive_every: int = 0
    tool_calls: int = 0
    reasoning: int = 0
    fault: str | None = None
    fault_after: int = 3
    fail_times: int = 0
    key: str = ""
    retry_after: float = 1.0
    stall_seconds: float = 5.0
    drip_seconds: float = 0.5
    delay_first_byte: float = 0.0
    oversized_mb: float = 2.0
    timestamps: bool = False
    finish_reason: str = "stop"
    words: str = ""  # the reply's words, cycled; empty: "tok0 tok1 ..."
    script: tuple[str, ...] = ()  # the stream's data fields verbatim, instead of the above
    error_status: int = 502  # the midstream_error chunk's code (its type follows from it)
    # server-only settings
    models: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    model: str = "mock-model"
    api_key: str | None = None
    record_send_times: bool = False
    batch_events: int = 16
    batch_bytes: int = 4096
    max_concurrent: int = 0  # a provider's caps: beyond them, HTTP 429 with Retry-After
    requests_per_minute: int = 0  # (0: none); counted in any 60 s, rejected ones included


_INT, _FLOAT, _BOOL, _STR, _OPT_STR, _STRS = "int", "float", "bool", "str", "str|None", "list[str]"
REQUEST_OPTIONS: dict[str, str] = {
    "tokens": _INT,
    "rate": _FLOAT,
    "tick": _FLOAT,
    "chunk_tokens": _INT,
    "keepalive_every": _INT,
    "tool_calls": _INT,
    "reasoning": _INT,
    "fault": _OPT_STR,
    "fault_after": _INT,
    "fail_times": _INT,
    "key": _STR,
    "retry_after": _FLOAT,
    "stall_seconds": _FLOAT,
    "drip_seconds": _FLOAT,
    "delay_first_byte": _FLOAT,
    "oversized_mb": _FLOAT,
    "timestamps": _BOOL,
    "finish_reason": _STR,
    "words": _STR,
    "script": _STRS,
    "error_status": _INT,
}
_ALIASES = {"stall_after": "fault_after"}


class MockRequestError(ValueError):
    """The request body or its ``mock`` object is invalid (answered with HTTP 400)."""


# --------------------------------------------------------------------------- options


def _coerce(name: str, value: Any, kind: str) -> Any:
    if name == "reasoning" and isinstance(value, bool):
        return _REASONING_DEFAULT if value else 0
    ok = {
        _INT: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        _FLOAT: isinstance(value, int | float) and not isinstance(value, bool) and value >= 0,
        _BOOL: isinstance(value, bool),
        _STR: isinstance(value, str),
        _OPT_STR: value is None or isinstance(value, str),
        _STRS: isinstance(value, list) and all(isinstance(item, str) for item in value),
    }[kind]
    if not ok:
        raise MockRequestError(f"mock.{name} must be a non-negative {kind}, got {value!r}")
    return float(value) if kind == _FLOAT else tuple(value) if kind == _STRS else value


def check_fault(fault: str | None) -> None:
    if fault is not None and fault not in FAULTS and not _HTTP_FAULT.fullmatch(fault):
        raise MockRequestError(f"unknown mock fault {fault!r}")


def resolve_options(request: dict[str, Any], config: MockConfig) -> MockConfig:
    """The effective options of one request: ``config`` overridden by its ``mock`` object."""
    mock = request.get("mock") or {}
    if not isinstance(mock, dict):
        raise MockRequestError("mock must be an object")
    model = request.get("model")
    per_model = config.models.get(model, {}) if isinstance(model, str) else {}
    changes: dict[str, Any] = {}
    for raw_name, value in {**per_model, **mock}.items():
        name = _ALIASES.get(raw_name, raw_name)
        if name not in REQUEST_OPTIONS:
            raise MockRequestError(f"unknown mock option {raw_name!r}")
        changes[name] = _coerce(name, value, REQUEST_OPTIONS[name])
    options = dataclasses.replace(config, **changes)
    check_fault(options.fault)
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < options.tokens:
        options = dataclasses.replace(options, tokens=limit, finish_reason="length")
    return dataclasses.replace(options, chunk_tokens=max(1, options.chunk_tokens))


# --------------------------------------------------------------------------- content


def _token_text(i: int, words: str = "") -> str:
    if words:
        vocabulary = words.split()
        word = vocabulary[i % len(vocabulary)]
        return word if i == 0 else f" {word}"
    return f"tok{i}" if i == 0 else f" tok{i}"


def _reasoning_text(i: int) -> str:
    return f"step {i}. "


def _tool_name(request: dict[str, Any], i: int) -> str:
    tools = request.get("tools")
    if isinstance(tools, list) and tools:
        tool = tools[i % len(tools)]
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            name = tool["function"].get("name")
            if isinstance(name, str):
                return name
    return f"tool_{i}"


def _tool_calls(request: dict[str, Any], options: MockConfig) -> list[tuple[str, str, str]]:
    """(id, function name, arguments JSON) of each tool call."""
    return [
        (f"call_mock_{i}", _tool_name(request, i), _dumps({"index": i, "query": f"q{i}"}))
        for i in range(options.tool_calls)
    ]


def expected_reply(request: dict[str, Any], config: MockConfig) -> str:
    """The content a successful (non-``timestamps``) request receives."""
    options = resolve_options(request, config)
    return "".join(_token_text(i, options.words) for i in range(options.tokens))


def expected_reasoning(request: dict[str, Any], config: MockConfig) -> str:
    """The concatenated ``reasoning.text`` of the request's reasoning fragments."""
    options = resolve_options(request, config)
    return "".join(_reasoning_text(i) for i in range(options.reasoning))


def expected_tool_calls(request: dict[str, Any], config: MockConfig) -> list[dict[str, Any]]:
    """The accumulated tool calls, in index order, as in a final ``message.tool_calls``."""
    options = resolve_options(request, config)
    return [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
        for id_, name, args in _tool_calls(request, options)
    ]


def expected_usage(request: dict[str, Any], config: MockConfig) -> dict[str, int]:
    """The usage object: prompt tokens are the words of the messages' contents."""
    options = resolve_options(request, config)
    messages = request.get("messages")
    prompt = sum(
        len(str(m.get("content") or "").split())
        for m in (messages if isinstance(messages, list) else [])
        if isinstance(m, dict)
    )
    completion = options.tokens + options.reasoning + options.tool_calls
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish_reason(options: MockConfig) -> str:
    return "tool_calls" if options.tool_calls else options.finish_reason


def _error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


_ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _error_kind(status: int) -> str:
    return _ERROR_KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")


def _completion(request: dict[str, Any], options: MockConfig, cid: str) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": expected_reply(request, options)}
    if options.tool_calls:
        message["tool_calls"] = expected_tool_calls(request, options)
    if options.reasoning:
        text = expected_reasoning(request, options)
        detail = {"type": "reasoning.text", "text": text, "format": "unknown", "index": 0}
        message["reasoning_details"] = [detail]
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model") or options.model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(options)}],
        "usage": expected_usage(request, options),
    }


# --------------------------------------------------------------------------- stream plan


class _Chunk(NamedTuple):
    data: bytes
    tokens: int  # weight for pacing; 0 = not a token chunk


class _Pause(NamedTuple):
    seconds: float


class _Abort:
    """Drop the connection here."""


class _Drip(NamedTuple):
    """Send ``head``, then "x", one byte every ``seconds``, and never end the event."""

    head: bytes
    seconds: float


_Item = _Chunk | _Pause | _Abort | _Drip
_KEEPALIVE = _Chunk(b": keep-alive\n\n", 0)
_DONE = _Chunk(b"data: [DONE]\n\n", 0)
_MALFORMED = _Chunk(b'data: {"id":"chatcmpl-mock","choices":[{"index":0,"delta":{"content":\n\n', 0)


class _StreamContext:
    """Pre-formatted JSON pieces of one stream; builds its chunks with string formatting."""

    def __init__(self, request: dict[str, Any], options: MockConfig, fault: str | None, cid: str):
        self.request = request
        self.options = options
        self.fault = fault
        model = _dumps(request.get("model") or options.model)
        created = int(time.time())
        self.envelope = (
            f'{{"id":"{cid}","object":"chat.completion.chunk","created":{created},"model":{model}'
        )
        self.head = f'data: {self.envelope},"choices":[{{"index":0,"delta":{{'
        self.role_pending = True
        stream_options = request.get("stream_options")
        self.include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )

    def delta(self, fields: str, tokens: int) -> _Chunk:
        if self.role_pending:
            self.role_pending = False
            fields = '"role":"assistant",' + fields
        return _Chunk(f'{self.head}{fields}}},"finish_reason":null}}]}}\n\n'.encode(), tokens)

    def finish(self) -> _Chunk:
        reason = _dumps(_finish_reason(self.options))
        return _Chunk(f'{self.head}}},"finish_reason":{reason}}}]}}\n\n'.encode(), 0)

    def usage(self) -> _Chunk:
        usage = _dumps(expected_usage(self.request, self.options))
        return _Chunk(f'data: {self.envelope},"choices":[],"usage":{usage}}}\n\n'.encode(), 0)

    def error(self) -> _Chunk:
        status = self.options.error_status
        error = _dumps(
            _error_body(status, "mock: upstream failed mid-stream", _error_kind(status))["error"]
        )
        choices = '[{"index":0,"delta":{},"finish_reason":"error"}]'
        return _Chunk(
            f'data: {self.envelope},"error":{error},"choices":{choices}}}\n\n'.encode(), 0
        )


def _reasoning_items(ctx: _StreamContext) -> Iterator[_Item]:
    for i in range(ctx.options.reasoning):
        detail = {
            "type": "reasoning.text",
            "text": _reasoning_text(i),
            "format": "unknown",
            "index": 0,
        }
        yield ctx.delta('"reasoning_details":' + _dumps([detail]), 1)


def _fault_items(ctx: _StreamContext) -> Generator[_Item, None, bool]:
    """The mid-stream fault's items; returns whether the stream goes on afterwards."""
    fault = ctx.fault
    if fault == "midstream_error":
        yield ctx.error()
        return False
    if fault == "disconnect":
        yield _Abort()
    if fault == "drip":
        yield _Drip(f'{ctx.head}"content":"'.encode(), ctx.options.drip_seconds)
    if fault in ("truncate", "disconnect", "drip"):
        return False
    if fault == "stall":
        yield _Pause(ctx.options.stall_seconds)
    elif fault == "malformed_json":
        yield _MALFORMED
    else:  # oversized_event
        yield ctx.delta('"content":"' + "x" * int(ctx.options.oversized_mb * 1048576) + '"', 0)
    return True


def _content_items(ctx: _StreamContext) -> Generator[_Item, None, bool]:
    """Content chunks with the mid-stream fault injected; returns whether to go on."""
    options = ctx.options
    pending = ctx.fault in MIDSTREAM_FAULTS
    for start in range(0, options.tokens, options.chunk_tokens):
        if pending and start >= options.fault_after:
            pending = False
            if not (yield from _fault_items(ctx)):
                return False
        count = min(options.chunk_tokens, options.tokens - start)
        if options.timestamps:
            text = "".join(f"{time.time():.6f} " for _ in range(count))
        else:
            text = "".join(_token_text(i, ctx.options.words) for i in range(start, start + count))
        yield ctx.delta('"content":' + _dumps(text), count)
    return (yield from _fault_items(ctx)) if pending else True


def _tool_items(ctx: _StreamContext) -> Iterator[_Item]:
    for index, (id_, name, args) in enumerate(_tool_calls(ctx.request, ctx.options)):
        function = {"name": name, "arguments": ""}
        first = {"index": index, "id": id_, "type": "function", "function": function}
        yield ctx.delta('"tool_calls":' + _dumps([first]), 1)
        for at in range(0, len(args), _ARG_FRAGMENT):
            fragment = {"index": index, "function": {"arguments": args[at : at + _ARG_FRAGMENT]}}
            yield ctx.delta('"tool_calls":' + _dumps([fragment]), 1)


def _body_items(ctx: _StreamContext) -> Iterator[_Item]:
    if ctx.options.script:
        yield from (_Chunk(f"data: {data}\n\n".encode(), 1) for data in ctx.options.script)
        return
    yield from _reasoning_items(ctx)
    if not (yield from _content_items(ctx)):
        return
    yield from _tool_items(ctx)
    if ctx.role_pending:
        yield ctx.delta('"content":""', 0)
    yield ctx.finish()
    if ctx.include_usage:
        yield ctx.usage()
    yield _DONE


def _with_keepalive(items: Iterator[_Item], every: int) -> Iterator[_Item]:
    yield _KEEPALIVE
    count = 0
    for item in items:
        yield item
        if isinstance(item, _Chunk) and item.tokens:
            count += 1
            if count % every == 0:
                yield _KEEPALIVE


def _stream_items(ctx: _StreamContext) -> Iterator[_Item]:
    every = ctx.options.keepalive_every or (1 if ctx.fault == "keepalive" else 0)
    items = _body_items(ctx)
    return _with_keepalive(items, every) if every else items


# --------------------------------------------------------------------------- I/O helpers


class _Pacer:
    """The next token is due at ``start + tokens_so_far / rate``: no drift; 0 = unpaced."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._tokens = 0

    def delay(self) -> float:
        """Seconds until the next token is due (<= 0: due now)."""
        if self._rate <= 0:
            return 0.0
        return self._start + self._tokens / self._rate - self._loop.time()

    def advance(self, tokens: int) -> None:
        self._tokens += tokens

    def restart(self) -> None:
        self._start = self._loop.time()
        self._tokens = 0


class _Writer:
    """Batches SSE events into body messages of up to ``max_events`` / ``max_bytes``."""

    def __init__(self, send: Send, max_events: int, max_bytes: int, yield_on_flush: bool):
        self._send = send
        self._max_events = max(1, max_events)
        self._max_bytes = max_bytes
        self._yield = yield_on_flush
        self._parts: list[bytes] = []
        self._size = 0

    async def add(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if len(self._parts) >= self._max_events or self._size >= self._max_bytes:
            await self.flush()

    async def flush(self) -> None:
        if self._parts:
            body = b"".join(self._parts)
            self._parts.clear()
            self._size = 0
            await self._send({"type": "http.response.body", "body": body, "more_body": True})
            if self._yield:
                await asyncio.sleep(0)  # let the other streams have the loop

    async def close(self) -> None:
        body = b"".join(self._parts)
        self._parts.clear()
        await self._send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(
    send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await _send_bytes(send, status, b"application/json", _dumps(payload).encode(), headers)


async def _send_bytes(
    send: Send,
    status: int,
    content_type: bytes,
    body: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    all_headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_http_fault(
    send: Send, status: int, options: MockConfig, *, as_sse: bool = False
) -> None:
    headers = []
    if status == 429:
        headers.append((b"retry-after", f"{options.retry_after:g}".encode()))
    kind = _error_kind(status)
    body = _error_body(status, f"mock: HTTP {status}", kind)
    if not as_sse:
        await _send_json(send, status, body, headers)
        return
    body["error"]["code"] = str(status)  # as LiteLLM sends it
    data = b"data: " + _dumps(body).encode() + b"\n\n"
    await _send_bytes(send, status, b"text/event-stream", data, headers)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _parse_request(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise MockRequestError(f"request body is not JSON: {exc}") from exc
    if not isinstance(request, dict):
        raise MockRequestError("request body must be a JSON object")
    return request


class _ExpectedAbortFilter(logging.Filter):
    """Hides uvicorn's complaint about a response the mock cut short on purpose."""

    MESSAGES = frozenset(
        {
            "ASGI callable returned without completing response.",
            "ASGI callable returned without starting response.",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in self.MESSAGES:
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return True
        return task not in self.tasks

    def expect(self) -> None:
        """The current task's ASGI call is about to return with its response cut short."""
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        logger = logging.getLogger("uvicorn.error")
        if self not in logger.filters:
            logger.addFilter(self)


_ABORT_FILTER = _ExpectedAbortFilter()


# --------------------------------------------------------------------------- the app

MAX_RECORDED_HEADERS = 256  # chat requests whose headers ``request_headers`` keeps
MAX_RECORDED_REQUESTS = 100_000  # chat requests whose arrival ``request_times`` keeps


def _recorded_headers(scope: Message) -> dict[str, str]:
    """A request's headers, lower-case names, without its authorization."""
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
    headers.pop("authorization", None)
    return headers


class MockUpstream:
    """The ASGI app. Holds the config and the observable counters (see module docstring)."""

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        self.requests: Counter[str] = Counter()
        self.key_requests: Counter[str] = Counter()
        self.model_requests: Counter[str] = Counter()  # chat requests per request model
        self.open_streams = 0
        self.streams_started = 0
        self.disconnects: list[tuple[str, float]] = []
        self.disconnected = asyncio.Event()
        self.send_times: list[float] = []
        self.in_progress = 0
        self.most_concurrent = 0
        self.rate_limited = 0
        self.rate_limited_at: list[float] = []  # time.monotonic() of each of those 429s
        self._recent: deque[float] = deque()  # request times
        self.request_times: deque[float] = deque(maxlen=MAX_RECORDED_REQUESTS)  # monotonic
        self.request_headers: deque[dict[str, str]] = deque(maxlen=MAX_RECORDED_HEADERS)
        self._completions = 0
        self._live: set[asyncio.Task[bool]] = set()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        self.requests[path] += 1
        if path.endswith("/chat/completions") and method == "POST":
            await self._chat(scope, receive, send)
        elif path.endswith("/models") and method == "GET":
            await self._models(scope, send)
        else:
            await _send_json(send, 404, _error_body(404, f"no route {method} {path}", "not_found"))

    def abort_streams(self) -> None:
        """Cut every response in progress short (used on shutdown)."""
        for task in list(self._live):
            task.cancel()

    def _authorized(self, scope: Message) -> bool:
        if self.config.api_key is None:
            return True
        expected = b"Bearer " + self.config.api_key.encode()
        return any(k == b"authorization" and v == expected for k, v in scope["headers"])

    async def _models(self, scope: Message, send: Send) -> None:
        if not self._authorized(scope):
            await _send_http_fault(send, 401, self.config)
            return
        model = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "mock"}
        await _send_json(send, 200, {"object": "list", "data": [model]})

    async def _chat(self, scope: Message, receive: Receive, send: Send) -> None:
        self.request_times.append(time.monotonic())
        self.request_headers.append(_recorded_headers(scope))
        body = await _read_body(receive)
        if body is None:
            return
        if not self._authorized(scope):
            await _send_http_fault(send, 401, self.config)
            return
        if self._over_limits():
            self.rate_limited += 1
            self.rate_limited_at.append(time.monotonic())
            await _send_http_fault(send, 429, self.config)
            return
        self.in_progress += 1
        self.most_concurrent = max(self.most_concurrent, self.in_progress)
        try:
            await self._chat_within_limits(scope, receive, send, body)
        finally:
            self.in_progress -= 1

    def _over_limits(self) -> bool:
        """A provider's caps (``max_concurrent``, ``requests_per_minute``) are reached."""
        config, now = self.config, time.monotonic()
        if config.requests_per_minute:
            while self._recent and self._recent[0] <= now - 60:
                self._recent.popleft()
            self._recent.append(now)
            if len(self._recent) > config.requests_per_minute:
                return True
        return bool(config.max_concurrent) and self.in_progress >= config.max_concurrent

    async def _chat_within_limits(
        self, scope: Message, receive: Receive, send: Send, body: bytes
    ) -> None:
        try:
            request = _parse_request(body)
            options = resolve_options(request, self.config)
        except MockRequestError as exc:
            await _send_json(send, 400, _error_body(400, str(exc), "invalid_request_error"))
            return
        seen = self.key_requests[options.key]
        self.key_requests[options.key] += 1
        self.model_requests[str(request.get("model"))] += 1
        fault = None if options.fail_times and seen >= options.fail_times else options.fault
        self._completions += 1
        cid = f"chatcmpl-mock{self._completions}"
        work = self._respond(send, request, options, fault, cid)
        if await self._guarded(work, receive, options.key):
            _ABORT_FILTER.expect()

    async def _guarded(self, work: Coroutine[Any, Any, bool], receive: Receive, key: str) -> bool:
        """Runs ``work`` until done or the client disconnects; returns whether to abort."""
        task = asyncio.create_task(work)
        watcher = asyncio.create_task(_until_disconnect(receive))
        self._live.add(task)
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._live.discard(task)
            watcher.cancel()
            if not task.done() and not watcher.done():
                task.cancel()  # we are being cancelled ourselves
        if not task.done():
            noticed_at = time.monotonic()
            task.cancel()
            await asyncio.wait((task,))  # its stream is closed (counted) before it is said
            self.disconnects.append((key, noticed_at))
            self.disconnected.set()
            return False
        return task.cancelled() or task.result()

    async def _respond(
        self, send: Send, request: dict[str, Any], options: MockConfig, fault: str | None, cid: str
    ) -> bool:
        """The whole response; returns True when the connection must be dropped."""
        delay = options.delay_first_byte
        if fault == "no_first_byte":
            delay += options.stall_seconds
        if delay > 0:
            await asyncio.sleep(delay)
        http_fault = _HTTP_FAULT.fullmatch(fault or "")
        if http_fault:
            as_sse = http_fault.group(1) == "sse"
            await _send_http_fault(send, int(http_fault.group(2)), options, as_sse=as_sse)
        elif fault == "json_200":
            body = _error_body(500, "mock: error in a 200 response", "server_error")
            await _send_json(send, 200, body)
        elif fault == "context_length":
            await _send_json(send, 400, CONTEXT_LENGTH_ERROR)
        elif fault == "wrong_content_type":
            await _send_bytes(send, 200, b"text/plain; charset=utf-8", b"mock: not an event stream")
        elif not request.get("stream"):
            await _send_json(send, 200, _completion(request, options, cid))
        else:
            return await self._stream(send, _StreamContext(request, options, fault, cid))
        return False

    async def _stream(self, send: Send, ctx: _StreamContext) -> bool:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self.open_streams += 1
        self.streams_started += 1
        try:
            return await self._pump(send, _stream_items(ctx), ctx.options)
        finally:
            self.open_streams -= 1

    async def _pump(self, send: Send, items: Iterator[_Item], options: MockConfig) -> bool:
        """Writes the items, paced and batched; returns True when told to abort."""
        config = self.config
        writer = _Writer(send, config.batch_events, config.batch_bytes, options.rate <= 0)
        pacer = _Pacer(options.rate)
        record = config.record_send_times
        while True:
            delay = pacer.delay()
            if delay > 0:  # what is due is written before sleeping; with a tick, coalesced
                await writer.flush()
                await asyncio.sleep(max(delay, options.tick))
            item = next(items, None)
            if item is None:
                break
            if isinstance(item, _Chunk):
                if record and item.tokens:
                    self.send_times.append(time.time())
                await writer.add(item.data)
                pacer.advance(item.tokens)
                continue
            await writer.flush()
            if isinstance(item, _Abort):
                return True
            if isinstance(item, _Drip):
                await _drip(send, item)
            await asyncio.sleep(item.seconds)
            pacer.restart()
        await writer.close()
        return False


async def _drip(send: Send, drip: _Drip) -> None:
    """One byte of an event that never ends, every ``drip.seconds``; until cancelled (the
    client went away)."""
    for sent in itertools.count():
        byte = drip.head[sent : sent + 1] or b"x"
        await send({"type": "http.response.body", "body": byte, "more_body": True})
        await asyncio.sleep(drip.seconds)


# --------------------------------------------------------------------------- serving


@contextlib.asynccontextmanager
async def serve_mock(
    host: str = "127.0.0.1", port: int = 0, *, app: MockUpstream | None = None, **config: Any
) -> AsyncIterator[str]:
    """Serve ``app`` (or ``MockUpstream(MockConfig(**config))``) in this event loop.

    Yields the base URL, e.g. ``"http://127.0.0.1:54321/v1"``. On exit, responses in
    progress are cut short and the server stops.
    """
    if app is None:
        app = MockUpstream(MockConfig(**config))
    elif config:
        raise TypeError("pass either app= or MockConfig fields, not both")
    sock = bind(host, port, backlog=4096, what="the mock upstream")
    uv_config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
    )
    server = EmbeddedServer(uv_config, name="mock-upstream", grace=2.0)
    async with served(server, sock) as bound:
        try:
            yield f"http://{f'[{host}]' if ':' in host else host}:{bound}/v1"
        finally:
            app.abort_streams()


_CONFIG_ENV = "CHATSTREAM_MOCK_CONFIG"


def app_from_env() -> MockUpstream:
    """App factory for worker processes: the config comes as JSON in $CHATSTREAM_MOCK_CONFIG."""
    return MockUpstream(MockConfig(**json.loads(os.environ.get(_CONFIG_ENV, "{}"))))


def run_mock(
    host: str = "127.0.0.1",
    port: int = 8900,
    config: MockConfig | None = None,
    *,
    workers: int = 1,
    log_level: str = "info",
) -> None:
    """Serve the mock until interrupted (blocking); for ``chatstream mock-upstream``.

    ``workers > 1`` runs that many processes on the port (counters are per process).
    """
    config = config or MockConfig()
    app: MockUpstream | str = MockUpstream(config)
    if workers > 1:
        os.environ[_CONFIG_ENV] = json.dumps(dataclasses.asdict(config))
        app = f"{__name__}:app_from_env"
    uvicorn.run(
        app,
        host=host,
        port=port,
        factory=workers > 1,
        workers=workers if workers > 1 else None,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        backlog=4096,
        timeout_graceful_shutdown=2,
    )
