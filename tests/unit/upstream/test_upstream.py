"""worker.upstream.client: the streaming call, retries before the first byte, error mapping."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest
import tenacity

from tests.helpers.fakes import InstantGateWaits
from worker.errors import (
    ChatstreamError,
    RetryableUpstreamError,
    TerminalUpstreamError,
    UnknownUpstreamError,
    UpstreamTimeoutError,
)
from worker.settings import Settings
from worker.upstream.client import UpstreamClient, retry_after_seconds

KEY = "sk-secret-123"
SSE = {"content-type": "text/event-stream"}
BODY: dict[str, Any] = {"model": "m", "messages": [], "stream": True}
EVENTS = [b'data: {"id":"1"}\n\n', b'data: {"id":"2"}\n\n', b"data: [DONE]\n\n"]

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]
Part = bytes | float | BaseException  # a chunk, a pause (seconds), or a failure


class Body(httpx.AsyncByteStream):
    """A response body that yields bytes, sleeps, or raises, and records being closed."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = parts
        self.closed = asyncio.Event()
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            if isinstance(part, BaseException):
                raise part
            if isinstance(part, float):
                await asyncio.sleep(part)
                continue
            self.sent += len(part)
            yield part

    async def aclose(self) -> None:
        self.closed.set()


def sse(*parts: Part, status: int = 200) -> httpx.Response:
    return httpx.Response(status, headers=SSE, stream=Body(parts))


def error(status: int, payload: Any, **headers: str) -> httpx.Response:
    return httpx.Response(status, json=payload, headers=headers)


class Upstream:
    """A scripted fake upstream: one step per call, the last repeats.

    A step is a response template (sent as a fresh copy sharing its body stream), an
    exception to raise, or an async handler.
    """

    def __init__(self, *script: httpx.Response | BaseException | Handler) -> None:
        self.script = list(script)
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, httpx.Response):  # a template: a response streams only once
            return httpx.Response(step.status_code, headers=step.headers, stream=step.stream)
        return await step(request)

    @property
    def calls(self) -> int:
        return len(self.requests)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("CHATSTREAM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def sleeps() -> Iterator[list[float]]:
    """The gates' backoff waits are recorded instead of waited."""
    with InstantGateWaits().installed() as clock:
        yield clock.waits


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "_env_file": None,
        "upstream_url": "http://up.test/v1",
        "upstream_api_key": KEY,
        "retry_attempts": 4,
        "retry_initial_backoff": 0.001,
        "retry_max_backoff": 0.002,
        "first_byte_timeout": 5.0,
        "idle_timeout": 5.0,
        **overrides,
    }
    return Settings(**values)


@asynccontextmanager
async def client_for(
    fake: Upstream, settings: Settings | None = None, **kwargs: Any
) -> AsyncIterator[UpstreamClient]:
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake)) as http:
        yield UpstreamClient(settings or make_settings(), http, **kwargs)


async def collect(client: UpstreamClient, name: str = "default") -> bytes:
    async with client.stream(name, BODY) as chunks:
        return b"".join([chunk async for chunk in chunks])


async def failure(client: UpstreamClient, name: str = "default") -> ChatstreamError:
    with pytest.raises(ChatstreamError) as info:
        await collect(client, name)
    return info.value


def assert_no_secret(exc: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    texts = [str(exc), repr(exc), caplog.text]
    if isinstance(exc, ChatstreamError):
        texts += [repr(exc.detail), json.dumps(exc.to_record())]
    for text in texts:
        assert KEY not in text


# --- success and routing ---------------------------------------------------------------


async def test_success_streams_the_body_bytes_in_order() -> None:
    fake = Upstream(sse(*EVENTS))
    async with client_for(fake) as client, client.stream("default", BODY) as chunks:
        received = [chunk async for chunk in chunks]
    assert b"".join(received) == b"".join(EVENTS)
    assert fake.calls == 1


async def test_request_method_url_body_and_headers() -> None:
    fake = Upstream(sse(*EVENTS))
    async with client_for(fake) as client:
        await collect(client)
    (request,) = fake.requests
    assert request.method == "POST"
    assert str(request.url) == "http://up.test/v1/chat/completions"
    assert json.loads(request.content) == BODY
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.headers["accept"] == "text/event-stream"
    assert request.headers["accept-encoding"] == "identity"
    assert request.headers["content-type"] == "application/json"


async def test_named_upstream_routes_to_its_url_key_and_headers() -> None:
    settings = make_settings(
        upstreams={
            "router": {
                "url": "https://router.test/api/v1/",
                "api_key": "sk-router-456",
                "headers": {"X-Title": "chatstream"},
            }
        }
    )
    fake = Upstream(sse(*EVENTS))
    async with client_for(fake, settings) as client:
        await collect(client, "router")
        await collect(client, "default")
    routed, default = fake.requests
    assert str(routed.url) == "https://router.test/api/v1/chat/completions"
    assert routed.headers["authorization"] == "Bearer sk-router-456"
    assert routed.headers["x-title"] == "chatstream"
    assert str(default.url) == "http://up.test/v1/chat/completions"
    assert "x-title" not in default.headers


async def test_no_api_key_sends_no_authorization_header() -> None:
    fake = Upstream(sse(*EVENTS))
    async with client_for(fake, make_settings(upstream_api_key=None)) as client:
        await collect(client)
    assert "authorization" not in fake.requests[0].headers


async def test_unknown_upstream_raises_without_any_http_call() -> None:
    fake = Upstream(sse(*EVENTS))
    async with client_for(fake) as client:
        with pytest.raises(UnknownUpstreamError):
            client.stream("http://evil.test/v1", BODY)
    assert fake.calls == 0


async def test_sse_content_type_with_parameters_is_accepted() -> None:
    response = httpx.Response(
        200, headers={"content-type": "Text/Event-Stream; charset=utf-8"}, stream=Body(EVENTS)
    )
    async with client_for(Upstream(response)) as client:
        assert await collect(client) == b"".join(EVENTS)


# --- retries before the first byte -----------------------------------------------------


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504])
async def test_retryable_status_is_retried(status: int, sleeps: list[float]) -> None:
    fake = Upstream(error(status, {"error": {"message": "busy"}}), sse(*EVENTS))
    async with client_for(fake) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 2
    assert len(sleeps) == 1
    assert 0 <= sleeps[0] <= 0.002  # full jitter within the tiny max backoff


async def test_500_502_503_retried_then_succeed(sleeps: list[float]) -> None:
    fake = Upstream(error(500, {}), error(502, {}), error(503, {}), sse(*EVENTS))
    async with client_for(fake) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 4
    assert len(sleeps) == 3


async def test_429_retry_after_seconds_is_the_wait(sleeps: list[float]) -> None:
    seen: list[tuple[BaseException, float]] = []
    fake = Upstream(error(429, {"error": {"message": "slow down"}}, **{"retry-after": "7"}))
    fake.script.append(sse(*EVENTS))
    async with client_for(fake, on_retry=lambda exc, wait: seen.append((exc, wait))) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert sleeps == [7.0]
    ((exc, wait),) = seen
    assert wait == 7.0
    assert isinstance(exc, RetryableUpstreamError)
    assert exc.status == 429
    assert exc.retry_after == 7.0


async def test_retry_after_zero_really_retries_at_once() -> None:
    fake = Upstream(error(429, {}, **{"retry-after": "0"}), sse(*EVENTS))
    settings = make_settings(retry_initial_backoff=10.0, retry_max_backoff=10.0)
    async with client_for(fake, settings) as client:
        started = time.monotonic()
        assert await collect(client) == b"".join(EVENTS)
    assert time.monotonic() - started < 1.0
    assert fake.calls == 2


async def test_retry_after_is_capped(sleeps: list[float]) -> None:
    fake = Upstream(error(503, {}, **{"retry-after": "3600"}), sse(*EVENTS))
    async with client_for(fake) as client:
        await collect(client)
    assert sleeps == [60.0]  # max(retry_max_backoff, 60)

    sleeps.clear()
    fake = Upstream(error(503, {}, **{"retry-after": "3600"}), sse(*EVENTS))
    async with client_for(fake, make_settings(retry_max_backoff=120.0)) as client:
        await collect(client)
    assert sleeps == [120.0]


def test_retry_after_parsing() -> None:
    def parse(**headers: str) -> float | None:
        return retry_after_seconds(httpx.Headers(headers))

    assert parse() is None
    assert parse(**{"retry-after": "2"}) == 2.0
    assert parse(**{"retry-after": "1.5"}) == 1.5
    assert parse(**{"retry-after": "-1"}) is None
    assert parse(**{"retry-after": "inf"}) is None
    assert parse(**{"retry-after": "soon"}) is None
    assert parse(**{"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    future = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    waited = parse(**{"retry-after": future})
    assert waited is not None and 25 < waited <= 30
    past = format_datetime(datetime.now(UTC) - timedelta(seconds=30), usegmt=True)
    assert parse(**{"retry-after": past}) == 0.0


async def test_exhaustion_raises_the_last_retryable_error_not_tenacitys(
    sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    fake = Upstream(error(503, {"error": {"message": "overloaded"}}))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert type(exc) is RetryableUpstreamError
    assert not isinstance(exc, tenacity.RetryError)
    assert not isinstance(exc.__context__, tenacity.RetryError)
    assert exc.status == 503
    assert exc.detail == {"message": "overloaded"}
    assert "'default'" in str(exc) and "503" in str(exc) and "4 attempts" in str(exc)
    assert fake.calls == 4
    assert len(sleeps) == 3
    assert_no_secret(exc, caplog)


async def test_single_attempt_setting_means_no_retry(sleeps: list[float]) -> None:
    fake = Upstream(error(503, {}))
    async with client_for(fake, make_settings(retry_attempts=1)) as client:
        exc = await failure(client)
    assert isinstance(exc, RetryableUpstreamError)
    assert "1 attempt)" in str(exc)
    assert fake.calls == 1
    assert sleeps == []


async def test_connection_error_is_retried(sleeps: list[float]) -> None:
    fake = Upstream(httpx.ConnectError("connection refused"), sse(*EVENTS))
    async with client_for(fake) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 2


async def test_connection_error_exhausted(
    sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    fake = Upstream(httpx.ConnectError("connection refused"))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert type(exc) is RetryableUpstreamError
    assert isinstance(exc.__cause__, httpx.ConnectError)
    assert "cannot connect to " in str(exc) and "(connection refused)" in str(exc)
    assert str(exc).endswith("(gave up after 4 attempts)")
    assert fake.calls == 4
    assert_no_secret(exc, caplog)


async def test_connect_timeout_is_an_upstream_timeout(sleeps: list[float]) -> None:
    fake = Upstream(httpx.ConnectTimeout("timed out"))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert isinstance(exc, UpstreamTimeoutError)
    assert fake.calls == 4


async def test_slow_first_byte_times_out_and_is_retried(sleeps: list[float]) -> None:
    fake = Upstream(sse(1.0, *EVENTS), sse(*EVENTS))
    async with client_for(fake, make_settings(first_byte_timeout=0.05)) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 2


async def test_slow_headers_time_out(sleeps: list[float]) -> None:
    async def stall(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(1.0)
        return sse(*EVENTS)

    fake = Upstream(stall)
    settings = make_settings(first_byte_timeout=0.05, retry_attempts=2)
    async with client_for(fake, settings) as client:
        exc = await failure(client)
    assert isinstance(exc, UpstreamTimeoutError)
    assert "no first byte in 0.05s" in str(exc)
    assert fake.calls == 2


@pytest.mark.parametrize(
    "reset", [httpx.RemoteProtocolError("peer closed"), httpx.ReadError("reset by peer")]
)
async def test_reset_before_first_byte_is_retried(reset: Exception, sleeps: list[float]) -> None:
    first = sse(reset)
    fake = Upstream(first, sse(*EVENTS))
    async with client_for(fake) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 2
    assert isinstance(first.stream, Body) and first.stream.closed.is_set()


async def test_empty_body_before_first_byte_is_retried(sleeps: list[float]) -> None:
    fake = Upstream(sse(b"", b""), sse(*EVENTS))
    async with client_for(fake) as client:
        assert await collect(client) == b"".join(EVENTS)
    assert fake.calls == 2


async def test_retries_are_logged_without_secrets(
    sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    """The upstream going down and coming back at WARNING, once each, the name said once;
    the job's retry at DEBUG only."""
    fake = Upstream(error(502, {"error": {"message": f"bad key {KEY}"}}), sse(*EVENTS))
    with caplog.at_level(logging.DEBUG, logger="chatstream.upstream"):
        async with client_for(fake) as client:
            await collect(client)
    down, retry, back = caplog.records
    assert {r.name for r in caplog.records} == {"chatstream.upstream"}
    assert (down.levelno, retry.levelno, back.levelno) == (logging.WARNING, logging.DEBUG, 30)
    assert down.getMessage().startswith(
        "upstream 'default' model 'm' is down (returned HTTP 502): "
    )
    assert down.getMessage().count("'default'") == 1
    message = retry.getMessage()
    assert "'default'" in message and "attempt 1" in message and "502" in message
    assert back.getMessage().startswith("upstream 'default' model 'm' is back after ")
    assert back.getMessage().endswith(" (1 job waited for it)")
    assert KEY not in caplog.text


async def test_cancellation_during_backoff_is_prompt() -> None:
    fake = Upstream(error(429, {}, **{"retry-after": "30"}))
    backing_off = asyncio.Event()
    async with client_for(fake, on_retry=lambda exc, wait: backing_off.set()) as client:
        task = asyncio.create_task(collect(client))
        await asyncio.wait_for(backing_off.wait(), 5)
        await asyncio.sleep(0.02)  # now inside the 30 s backoff sleep
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert time.monotonic() - started < 0.25
    assert fake.calls == 1


# --- terminal errors -------------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_other_4xx_is_terminal_with_the_error_object(
    status: int, sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    error_object = {"message": "invalid request", "type": "invalid_request_error", "code": None}
    fake = Upstream(error(status, {"error": error_object}))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert type(exc) is TerminalUpstreamError
    assert exc.status == status
    assert exc.detail == error_object
    assert f"HTTP {status}" in str(exc) and "'default'" in str(exc)
    assert exc.to_record()["status"] == status
    assert fake.calls == 1
    assert sleeps == []
    assert_no_secret(exc, caplog)


async def test_401_echoing_the_key_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    payload = {"error": {"message": f"Incorrect API key provided: {KEY}"}}
    fake = Upstream(error(401, payload))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert exc.detail == {"message": "Incorrect API key provided: [REDACTED]"}
    assert_no_secret(exc, caplog)


async def test_4xx_with_a_text_body_keeps_a_snippet() -> None:
    fake = Upstream(httpx.Response(400, text="bad request " + "x" * 1000))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert isinstance(exc, TerminalUpstreamError)
    assert isinstance(exc.detail, str)
    assert exc.detail.startswith("'bad request x") and len(exc.detail) < 300


async def test_json_without_error_member_is_kept_whole() -> None:
    fake = Upstream(error(400, {"detail": "missing messages"}))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert exc.detail == {"detail": "missing messages"}


async def test_error_body_read_is_capped() -> None:
    body = Body([b"x" * 16384] * 640)  # 10 MiB
    fake = Upstream(httpx.Response(400, stream=body))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert isinstance(exc, TerminalUpstreamError)
    assert body.sent <= 64 * 1024
    assert body.closed.is_set()


async def test_200_json_error_body_is_terminal_with_detail(sleeps: list[float]) -> None:
    fake = Upstream(error(200, {"error": {"message": "quota exceeded", "code": 402}}))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert type(exc) is TerminalUpstreamError
    assert exc.status == 200
    assert exc.detail == {"message": "quota exceeded", "code": 402}
    assert "application/json" in str(exc) and "text/event-stream" in str(exc)
    assert fake.calls == 1


async def test_200_with_the_wrong_content_type_is_terminal() -> None:
    fake = Upstream(httpx.Response(200, html="<html>login</html>"))
    async with client_for(fake) as client:
        exc = await failure(client)
    assert isinstance(exc, TerminalUpstreamError)
    assert "text/html" in str(exc)
    assert exc.detail == "'<html>login</html>'"
    assert fake.calls == 1


# --- after the first byte --------------------------------------------------------------


async def test_idle_timeout_mid_stream(sleeps: list[float]) -> None:
    # httpx's read timeout is the idle timeout (a MockTransport has no socket to time out,
    # so the body raises what httpx raises; tests/test_faults.py stalls a real socket)
    fake = Upstream(sse(EVENTS[0], httpx.ReadTimeout("timed out"), EVENTS[1]))
    received: list[bytes] = []
    async with client_for(fake, make_settings(idle_timeout=0.05)) as client:
        with pytest.raises(UpstreamTimeoutError, match=r"no data for 0\.05s"):
            async with client.stream("default", BODY) as chunks:
                async for chunk in chunks:
                    received.append(chunk)
    assert received == [EVENTS[0]]
    assert fake.calls == 1  # never retried after the first byte
    assert sleeps == []


async def test_disconnect_mid_stream_is_retryable_and_not_retried(
    sleeps: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    fake = Upstream(sse(EVENTS[0], httpx.RemoteProtocolError("peer closed connection")))
    received: list[bytes] = []
    async with client_for(fake) as client:
        with pytest.raises(RetryableUpstreamError) as info:
            async with client.stream("default", BODY) as chunks:
                async for chunk in chunks:
                    received.append(chunk)
    exc = info.value
    assert type(exc) is RetryableUpstreamError
    assert "disconnected mid-stream" in str(exc) and "'default'" in str(exc)
    assert isinstance(exc.__cause__, httpx.RemoteProtocolError)
    assert received == [EVENTS[0]]
    assert fake.calls == 1
    assert sleeps == []
    assert_no_secret(exc, caplog)


# --- closing ---------------------------------------------------------------------------


async def test_leaving_early_closes_the_response() -> None:
    response = sse(EVENTS[0], 30.0, EVENTS[1])
    async with client_for(Upstream(response)) as client:
        async with client.stream("default", BODY) as chunks:
            async for _chunk in chunks:
                break
        assert isinstance(response.stream, Body) and response.stream.closed.is_set()


async def test_an_exception_in_the_block_closes_the_response() -> None:
    response = sse(*EVENTS)
    async with client_for(Upstream(response)) as client:
        with pytest.raises(KeyError):
            async with client.stream("default", BODY):
                raise KeyError("consumer failed")
        assert isinstance(response.stream, Body) and response.stream.closed.is_set()


async def test_cancellation_mid_stream_closes_the_response_promptly() -> None:
    response = sse(EVENTS[0], 30.0)
    first = asyncio.Event()

    async def consume(client: UpstreamClient) -> None:
        async with client.stream("default", BODY) as chunks:
            async for _chunk in chunks:
                first.set()

    async with client_for(Upstream(response)) as client:
        task = asyncio.create_task(consume(client))
        await first.wait()
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert isinstance(response.stream, Body)
        await asyncio.wait_for(response.stream.closed.wait(), 0.25)
    assert time.monotonic() - started < 0.25


@pytest.fixture
async def tcp_upstream() -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A real socket server: SSE headers and one event, then silence until the peer leaves."""
    disconnected = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + f"{len(EVENTS[0]):x}\r\n".encode()
            + EVENTS[0]
            + b"\r\n"
        )
        await writer.drain()
        await reader.read()  # returns at EOF: the client closed the connection
        disconnected.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}/v1", disconnected


@pytest.mark.parametrize("how", ["cancel", "break"])
async def test_real_connection_is_closed_promptly(
    how: str, tcp_upstream: tuple[str, asyncio.Event]
) -> None:
    url, disconnected = tcp_upstream
    first = asyncio.Event()

    async def consume(client: UpstreamClient) -> None:
        async with client.stream("default", BODY) as chunks:
            async for _chunk in chunks:
                first.set()
                if how == "break":
                    break

    async with UpstreamClient(make_settings(upstream_url=url)) as client:  # owns its pool
        task = asyncio.create_task(consume(client))
        await asyncio.wait_for(first.wait(), 5)
        if how == "cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await task
        await asyncio.wait_for(disconnected.wait(), 0.25)  # while the client (pool) lives on


async def test_injected_http_client_is_not_closed_by_aclose() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(Upstream(sse(*EVENTS)))) as http:
        client = UpstreamClient(make_settings(), http)
        await client.aclose()
        assert not http.is_closed
