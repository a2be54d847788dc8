"""worker.upstream.transport: httpx over asyncio protocols and httptools, under real sockets.

The upstream tests (test_upstream, test_faults, test_security) go through it for every
loopback call (it is the default transport where httptools is installed); these pin what
is its own: responses split at every byte boundary, keep-alive and its limits, the four
timeouts (the read timeout by one sweep, no timer per read), flow control, TLS, the errors
and their causes, and that the worker's client really uses it.
"""

from __future__ import annotations

import asyncio
import gzip
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

pytest.importorskip("httptools", reason="the httptools transport needs the fast extra")

from tests.helpers.checks import eventually
from tests.helpers.tls import make_certs
from worker.aio import URGENT, socket_of
from worker.errors import ConfigError, RetryableUpstreamError, UpstreamTimeoutError
from worker.settings import Settings
from worker.speedups import chosen_transport
from worker.upstream import BODY_EXTENSION
from worker.upstream.client import UpstreamClient
from worker.upstream.transport import HIGH_WATER, HttptoolsTransport, _Connection

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
BODY: dict[str, Any] = {"model": "m", "messages": [], "stream": True}
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@asynccontextmanager
async def server(
    serve: Serve, context: ssl.SSLContext | None = None, connections: list[int] | None = None
) -> AsyncIterator[str]:
    """A raw HTTP server: ``serve`` answers each request (the head was read already)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.append(1)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"{'https' if context else 'http'}://127.0.0.1:{port}/v1"


async def sse_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + chunked(EVENT) + chunked(DONE) + b"0\r\n\r\n")
    await writer.drain()


def settings_for(url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "_env_file": None,
        "upstream_url": url,
        "retry_attempts": 1,
        "first_byte_timeout": 5.0,
        "idle_timeout": 5.0,
        "http_transport": "httptools",
        **overrides,
    }
    return Settings(**values)


async def collect(client: UpstreamClient) -> bytes:
    async with client.stream("default", BODY) as chunks:
        return b"".join([chunk async for chunk in chunks])


@asynccontextmanager
async def http(**limits: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = HttptoolsTransport(limits=httpx.Limits(**limits) if limits else None)
    async with httpx.AsyncClient(transport=transport, timeout=5.0) as client:
        yield client


# --- the worker uses it ----------------------------------------------------------------------


async def test_the_upstream_client_reads_through_the_httptools_transport() -> None:
    calls: list[str] = []
    original = HttptoolsTransport.handle_async_request

    async def spy(self: HttptoolsTransport, request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        return await original(self, request)

    settings = settings_for("http://x/v1", http_transport="auto")
    assert chosen_transport(settings) == "httptools"
    async with server(sse_once) as url:
        client = UpstreamClient(settings.model_copy(update={"upstream_url": url}))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(HttptoolsTransport, "handle_async_request", spy)
            async with client:
                assert await collect(client) == EVENT + DONE
    assert calls == [f"{url}/chat/completions"]


def test_a_proxy_in_the_environment_means_httpx_s_own_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert chosen_transport(settings_for("http://x/v1", http_transport="auto")) == "httpx"
    with pytest.raises(ConfigError, match="proxies"):
        chosen_transport(settings_for("http://x/v1"))


def test_without_httptools_auto_falls_back_and_forcing_it_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker import speedups

    monkeypatch.setattr(speedups, "httptools_installed", lambda: False)
    assert chosen_transport(settings_for("http://x/v1", http_transport="auto")) == "httpx"
    with pytest.raises(ConfigError, match="not installed"):
        chosen_transport(settings_for("http://x/v1"))


# --- parsing: a response split anywhere --------------------------------------------------------


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


def parsed(*pieces: bytes, lost: bool = False) -> _Connection:
    connection = _Connection(("http", "h", 80))
    connection.connection_made(FakeTransport())
    connection.busy = True
    for piece in pieces:
        connection.data_received(piece)
    if lost:
        connection.connection_lost(None)
    return connection


RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Long-Header: "
    + b"v" * 40
    + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    + chunked(EVENT)
    + chunked(EVENT.replace(b"x", "é".encode()))
    + chunked(DONE)
    + b"0\r\n\r\n"
)
EXPECTED = EVENT + EVENT.replace(b"x", "é".encode()) + DONE


async def test_a_chunked_response_split_at_every_byte_boundary_parses_the_same() -> None:
    for cut in range(1, len(RESPONSE)):
        connection = parsed(RESPONSE[:cut], RESPONSE[cut:])
        assert connection.complete, cut
        assert connection.parser.get_status_code() == 200
        assert dict(connection.headers)[b"X-Long-Header"] == b"v" * 40
        assert connection.take() == EXPECTED, cut


async def test_a_response_fed_one_byte_at_a_time_parses_the_same() -> None:
    connection = parsed(*(RESPONSE[i : i + 1] for i in range(len(RESPONSE))))
    assert connection.complete and connection.reason == b"OK"
    assert connection.take() == EXPECTED


async def test_content_length_and_read_until_close_bodies() -> None:
    sized = parsed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo")
    assert sized.complete and sized.take() == b"hello"
    until_close = parsed(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n", EVENT)
    assert not until_close.complete
    until_close.connection_lost(None)
    assert until_close.complete and until_close.error is None
    assert until_close.take() == EVENT


async def test_a_cut_chunked_body_or_no_response_is_a_protocol_error() -> None:
    cut = parsed(RESPONSE[:-20], lost=True)
    assert not cut.complete and isinstance(cut.error, httpx.RemoteProtocolError)
    nothing = parsed(lost=True)
    assert isinstance(nothing.error, httpx.RemoteProtocolError)
    assert "without sending a response" in str(nothing.error)


async def test_garbage_is_a_protocol_error_and_closes_the_connection() -> None:
    connection = parsed(b"\x15\x03\x03\x00\x02\x02\x46")  # a TLS alert on a plain port
    assert isinstance(connection.error, httpx.RemoteProtocolError)
    assert connection.closed


async def test_an_interim_100_continue_is_skipped() -> None:
    connection = parsed(b"HTTP/1.1 100 Continue\r\n\r\n" + RESPONSE)
    assert connection.complete and connection.parser.get_status_code() == 200
    assert connection.take() == EXPECTED


# --- pooling -----------------------------------------------------------------------------------


async def test_keep_alive_reuses_one_connection() -> None:
    connections: list[int] = []
    async with server(sse_once, connections=connections) as url, http() as client:
        for _ in range(3):
            response = await client.post(url, json=BODY)
            assert response.content == EVENT + DONE
    assert len(connections) == 1


async def test_connection_close_or_a_server_gone_idle_means_a_new_connection() -> None:
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    async with server(serve, connections=connections) as url, http() as client:
        for _ in range(3):
            assert (await client.get(url)).content == b"ok"
            await asyncio.sleep(0.05)  # the close has arrived before the next request
    assert len(connections) == 3


async def test_a_bursts_idle_connections_close_at_the_expiry_though_the_server_keeps_them() -> None:
    """The server never closes an idle connection (as providers keep them for minutes):
    the connections a burst opened are closed by us once idle for the expiry, without a
    request coming to find them (before, they stayed open until reused)."""
    writers: set[asyncio.StreamWriter] = set()

    async def slow_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        await asyncio.sleep(0.05)  # the burst's requests overlap: one connection each
        await sse_once(reader, writer)

    async def closed_by_us() -> bool:  # the server closes its side once it reads our EOF
        return all(writer.is_closing() for writer in writers)

    async with server(slow_once) as url, http(keepalive_expiry=0.3) as client:
        responses = await asyncio.gather(*[client.post(url, json=BODY) for _ in range(8)])
        assert [r.content for r in responses] == [EVENT + DONE] * 8
        assert len(writers) == 8
        await asyncio.sleep(0.1)
        assert not await closed_by_us()  # idle, not yet expired: kept for reuse
        await eventually(closed_by_us, timeout=2)
        assert (await client.post(url, json=BODY)).content == EVENT + DONE
        assert len(writers) == 9


async def test_a_stream_left_early_closes_its_connection_and_frees_its_slot() -> None:
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT))
        await writer.drain()
        await asyncio.sleep(5)

    async with server(serve, connections=connections) as url, http(max_connections=1) as client:
        for _ in range(2):
            async with client.stream("POST", url, json=BODY) as response:
                assert await anext(response.aiter_raw()) == EVENT
    assert len(connections) == 2


async def test_no_free_connection_in_time_is_a_pool_timeout() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT))
        await writer.drain()
        await asyncio.sleep(5)

    async with (
        server(serve) as url,
        http(max_connections=1) as client,
        client.stream("POST", url, json=BODY),
    ):
        with pytest.raises(httpx.PoolTimeout):
            await client.post(url, json=BODY, timeout=httpx.Timeout(5.0, pool=0.1))


async def test_a_cancelled_request_gives_its_slot_back() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with server(silent) as url, http(max_connections=1) as client:
        request = asyncio.ensure_future(client.get(url))
        await asyncio.sleep(0.1)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        with pytest.raises(httpx.ReadTimeout):  # got the slot: waits for headers, not the pool
            await client.get(url, timeout=httpx.Timeout(0.2, pool=0.05))


# --- timeouts ----------------------------------------------------------------------------------


async def test_a_stall_mid_stream_is_the_idle_timeout() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT))
        await writer.drain()
        await asyncio.sleep(5)

    received: list[bytes] = []
    async with server(serve) as url, UpstreamClient(settings_for(url, idle_timeout=0.2)) as client:
        began = time.monotonic()
        with pytest.raises(UpstreamTimeoutError, match=r"no data for 0\.2s"):
            async with client.stream("default", BODY) as chunks:
                async for chunk in chunks:
                    received.append(chunk)
        waited = time.monotonic() - began
    assert received == [EVENT]
    assert 0.2 <= waited < 2


async def test_headers_that_never_come_are_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with server(silent) as url, http() as client:
        began = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url, timeout=httpx.Timeout(5.0, read=0.2))
        assert 0.2 <= time.monotonic() - began < 2


async def test_a_slow_connect_is_a_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def never(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(5)

    monkeypatch.setattr(loop, "create_connection", never)
    async with http() as client:
        with pytest.raises(httpx.ConnectTimeout):
            await client.get("http://127.0.0.1:9/", timeout=httpx.Timeout(5.0, connect=0.1))


async def test_many_reads_arm_no_timer_per_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read timeout is one sweep per transport: 200 waits arm at most a few timers."""
    gate = asyncio.Queue[bytes]()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        while (data := await gate.get()) != b"":
            writer.write(chunked(data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    loop = asyncio.get_running_loop()
    armed: list[float] = []
    original = loop.call_at

    def counting(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return original(when, callback, *args, **kwargs)

    async with (
        server(serve) as url,
        http() as client,
        client.stream("POST", url, json=BODY) as response,
    ):
        reads = response.aiter_raw()
        monkeypatch.setattr(loop, "call_at", counting)
        for i in range(200):
            await gate.put(b"%d" % i)
            assert await anext(reads) == b"%d" % i
        monkeypatch.undo()
        await gate.put(b"")
    assert len(armed) <= 3  # the sweep's own re-arming (every 0.5 s of a 5 s read timeout)


# --- flow control, TLS, bodies ---------------------------------------------------------------


async def test_a_body_larger_than_the_buffer_limit_arrives_whole() -> None:
    payload = b"data: " + b"x" * (4 * HIGH_WATER) + b"\n\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(payload) + b"0\r\n\r\n")
        await writer.drain()

    async with (
        server(serve) as url,
        UpstreamClient(settings_for(url)) as client,
        client.stream("default", BODY) as chunks,
    ):
        await asyncio.sleep(0.2)  # the server's writes pile up: reading pauses
        body = b"".join([chunk async for chunk in chunks])
    assert body == payload


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_certs(tmp_path_factory.mktemp("certs"))


def server_context(certs: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)
    return context


async def test_https_upstream_trusted_through_ssl_cert_file(
    certs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    connections: list[int] = []
    async with (
        server(sse_once, server_context(certs), connections) as url,
        UpstreamClient(settings_for(url)) as client,
    ):
        assert await collect(client) == EVENT + DONE
        assert await collect(client) == EVENT + DONE  # a pooled connection
    assert len(connections) == 1


async def test_https_upstream_with_an_untrusted_certificate_is_refused(
    certs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.other_ca))
    async with (
        server(sse_once, server_context(certs)) as url,
        UpstreamClient(settings_for(url)) as client,
    ):
        with pytest.raises(
            RetryableUpstreamError, match=r"TLS certificate of .* not trusted"
        ) as info:
            await collect(client)
    chain: list[BaseException] = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert any(isinstance(e, ssl.SSLCertVerificationError) for e in chain)


async def test_refused_and_reset_connections_keep_their_os_errors() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    async with http() as client:
        with pytest.raises(httpx.ConnectError) as refused:
            await client.get("http://127.0.0.1:9/")
        assert isinstance(refused.value.__cause__, ConnectionRefusedError)
        async with server(reset) as url:
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)) as dropped:
                await client.get(url)
    assert isinstance(dropped.value.__cause__, (OSError, type(None)))


async def test_a_compressed_body_is_still_decoded() -> None:
    """We ask for identity; an upstream that gzips anyway is decoded (aiter_bytes), whether
    the body is iterated or fed (then it is iterated under the callback)."""
    body = gzip.compress(EVENT + DONE)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = HEAD.replace(b"\r\n\r\n", b"\r\ncontent-encoding: gzip\r\n\r\n")
        writer.write(head + chunked(body[:10]) + chunked(body[10:]) + b"0\r\n\r\n")
        await writer.drain()

    async with server(serve) as url, UpstreamClient(settings_for(url)) as client:
        assert await collect(client) == EVENT + DONE
        assert b"".join(await fed(client)) == EVENT + DONE


async def test_an_identity_body_arrives_read_by_read() -> None:
    """Unencoded, each socket read reaches the relay as it came (aiter_raw)."""
    gate = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT))
        await writer.drain()
        await gate.wait()
        writer.write(chunked(DONE) + b"0\r\n\r\n")
        await writer.drain()

    async with (
        server(serve) as url,
        UpstreamClient(settings_for(url)) as client,
        client.stream("default", BODY) as chunks,
    ):
        received = [await anext(chunks)]
        gate.set()
        received += [chunk async for chunk in chunks]
    assert received == [EVENT, DONE]


# --- a body fed to a callback (what the pipeline does) ----------------------------------------


async def fed(client: UpstreamClient, stop_at: int | None = None) -> list[bytes]:
    """The reads ``feed`` hands over (stopping after ``stop_at`` of them)."""
    reads: list[bytes] = []

    def consume(data: bytes) -> bool:
        reads.append(data)
        return len(reads) == stop_at

    async with client.stream("default", BODY) as body:
        await body.feed(consume)
    return reads


def dripping(parts: list[bytes], every: float) -> Serve:
    """A server that sends ``parts`` one per ``every`` seconds, then ends the body."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        for part in parts:
            await asyncio.sleep(every)
            writer.write(chunked(part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    return serve


async def test_a_fed_body_arrives_read_by_read_without_waking_the_reader_per_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each read goes to the callback from the connection's data callback: the task that
    feeds waits once for the whole body, not once per read."""
    waits: list[int] = []
    original = _Connection.wait

    async def counted(self: _Connection) -> None:
        waits.append(1)
        await original(self)

    monkeypatch.setattr(_Connection, "wait", counted)
    parts = [b"%d" % i for i in range(20)]
    async with server(dripping(parts, 0.01)) as url, UpstreamClient(settings_for(url)) as client:
        reads = await fed(client)
    assert b"".join(reads) == b"".join(parts) and len(reads) >= 15  # (one read each, mostly)
    assert len(waits) <= 3  # the first byte, the body, its end


async def test_a_fed_body_stops_where_the_callback_says_and_is_not_reused() -> None:
    connections: list[int] = []
    parts = [b"a", b"b", b"c"]
    async with (
        server(dripping(parts, 0.02), connections=connections) as url,
        UpstreamClient(settings_for(url)) as client,
    ):
        assert await fed(client, stop_at=2) == [b"a", b"b"]
        assert await fed(client) == parts  # a new connection: the first one was left mid-body
    assert len(connections) == 2


async def test_what_the_callback_raises_is_raised_by_feed_and_ends_the_stream() -> None:
    seen: list[bytes] = []

    def consume(data: bytes) -> bool:
        seen.append(data)
        if len(seen) == 2:
            raise ValueError("bad event")
        return False

    async with (
        server(dripping([b"a", b"b", b"c"], 0.02)) as url,
        UpstreamClient(settings_for(url)) as client,
    ):
        with pytest.raises(ValueError, match="bad event"):
            async with client.stream("default", BODY) as body:
                await body.feed(consume)
    assert seen == [b"a", b"b"]


async def test_a_fed_body_that_keeps_coming_is_not_timed_out_but_a_stall_is() -> None:
    """The read timeout counts from the last read: 8 reads 0.1 s apart outlive a 0.3 s
    timeout; a silence of it ends the stream."""
    parts = [b"%d" % i for i in range(8)]
    settings = {"idle_timeout": 0.3}
    async with (
        server(dripping(parts, 0.1)) as url,
        UpstreamClient(settings_for(url, **settings)) as client,
    ):
        assert b"".join(await fed(client)) == b"".join(parts)

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(b"a"))
        await writer.drain()
        await asyncio.sleep(5)

    async with server(stall) as url, UpstreamClient(settings_for(url, **settings)) as client:
        began = time.monotonic()
        with pytest.raises(UpstreamTimeoutError, match=r"no data for 0\.3s"):
            await fed(client)
        assert 0.3 <= time.monotonic() - began < 0.9


async def test_a_response_is_urgent_until_its_second_body_read(urgent_set: None) -> None:
    """The head, the first byte and the read after it (the first token) end a wake-up
    tick's sleep; the body's further reads wait for the tick (worker.aio.URGENT)."""
    writes: asyncio.Queue[bytes] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await writes.get():
            writer.write(data)
            await writer.drain()

    async with server(serve) as url, http() as client:
        await writes.put(HEAD)
        async with client.stream("POST", url, json=BODY) as response:
            body = response.extensions[BODY_EXTENSION]
            sock = socket_of(body._connection.transport)
            assert sock is not None and URGENT.watching(sock)
            reads = response.aiter_raw()
            for urgent in (True, False):
                await writes.put(chunked(EVENT))
                assert await anext(reads) == EVENT
                assert URGENT.watching(sock) is urgent
            await writes.put(chunked(DONE) + b"0\r\n\r\n")
            assert [data async for data in reads] == [DONE]
        await writes.put(b"")


@pytest.mark.parametrize("transport", ["httptools", "httpx"])
async def test_under_httpxs_transport_the_tick_is_short_until_the_first_byte(
    transport: str,
) -> None:
    """httpx's own transport does not show its sockets: while a try waits for its first
    byte, the wake-up tick's sleeps are short instead (ours watches the socket)."""
    asked, answer = asyncio.Event(), asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked.set()
        await answer.wait()
        await sse_once(reader, writer)

    async with (
        server(serve) as url,
        UpstreamClient(settings_for(url, http_transport=transport)) as client,
    ):
        reading = asyncio.create_task(collect(client))
        await asked.wait()
        assert URGENT.hurrying is (transport == "httpx")
        answer.set()
        assert await reading == EVENT + DONE
        assert not URGENT.hurrying


async def test_a_request_body_of_unknown_length_is_sent_chunked() -> None:
    got: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"0\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def parts() -> AsyncIterator[bytes]:
        yield b"hello "
        yield b"world"

    async with server(serve) as url, http() as client:
        assert (await client.post(url, content=parts())).status_code == 200
    assert got == [b"6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n"]


async def test_schemes_other_than_http_are_refused() -> None:
    async with http() as client:
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("ftp://127.0.0.1/")
