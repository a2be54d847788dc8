"""worker.netio: httpcore's network backend on an asyncio Protocol, under real sockets.

The upstream tests (test_upstream, test_faults, test_security) go through it for every
loopback call; these pin what is its own: the lazy read timeout, flow control on large
bodies, TLS (verified, and refused when the certificate is not trusted), and that httpx's
pools really use it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpcore
import httpx
import pytest

from tests.test_tls import make_certs
from worker.errors import RetryableUpstreamError, UpstreamTimeoutError
from worker.netio import HIGH_WATER, ProtocolBackend, ProtocolStream, _Reader, use_protocol_backend
from worker.settings import Settings
from worker.upstream import UpstreamClient

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
BODY: dict[str, Any] = {"model": "m", "messages": [], "stream": True}
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@asynccontextmanager
async def server(serve: Serve, context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
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


def settings_for(url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "_env_file": None,
        "upstream_url": url,
        "retry_attempts": 1,
        "first_byte_timeout": 5.0,
        "idle_timeout": 5.0,
        **overrides,
    }
    return Settings(**values)


async def collect(client: UpstreamClient) -> bytes:
    async with client.stream("default", BODY) as chunks:
        return b"".join([chunk async for chunk in chunks])


# --- the pools use it --------------------------------------------------------------------


async def test_the_upstream_client_reads_through_the_protocol_backend() -> None:
    seen: list[type] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT) + b"0\r\n\r\n")
        await writer.drain()

    async with server(serve) as url, UpstreamClient(settings_for(url)) as client:
        original = ProtocolStream.read

        async def spy(self: ProtocolStream, max_bytes: int, timeout: float | None = None) -> bytes:
            seen.append(type(self))
            return await original(self, max_bytes, timeout)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ProtocolStream, "read", spy)
            assert await collect(client) == EVENT
    assert seen and set(seen) == {ProtocolStream}


def test_use_protocol_backend_covers_environment_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    client = httpx.AsyncClient()
    assert use_protocol_backend(client)
    pools = [client._transport._pool, *(t._pool for t in client._mounts.values() if t)]  # type: ignore[attr-defined]
    assert len(pools) >= 2
    assert all(isinstance(pool._network_backend, ProtocolBackend) for pool in pools)


# --- the lazy read timeout -----------------------------------------------------------------


async def test_many_reads_arm_one_timer() -> None:
    reader = _Reader()
    armed: list[float] = []
    loop = asyncio.get_running_loop()
    original = loop.call_at

    def counting(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return original(when, callback, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "call_at", counting)
        for i in range(200):
            read = asyncio.ensure_future(reader.read(65536, 60.0))
            await asyncio.sleep(0)
            reader.data_received(b"%d" % i)
            assert await read == b"%d" % i
    assert len(armed) == 1


async def test_a_wait_after_earlier_reads_times_out_after_its_own_timeout() -> None:
    reader = _Reader()
    first = asyncio.ensure_future(reader.read(100, 0.3))
    await asyncio.sleep(0.15)
    reader.data_received(b"a")  # the timer armed for the first wait stays (lazy)
    assert await first == b"a"
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await reader.read(100, 0.3)  # the timer fires at 0.3, sees 0.15 s of waiting, re-arms
    assert 0.28 <= time.monotonic() - began < 1.0


async def test_data_already_buffered_is_returned_without_waiting() -> None:
    reader = _Reader()
    reader.data_received(b"ab")
    reader.data_received(b"cd")
    assert await reader.read(3, 0.0) == b"abc"
    assert await reader.read(3, 0.0) == b"d"
    reader.eof_received()
    assert await reader.read(3, 0.0) == b""


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
    assert received == [EVENT]
    assert time.monotonic() - began < 2


async def test_a_connection_lost_mid_stream_is_a_read_error() -> None:
    reader = _Reader()
    reader.connection_lost(ConnectionResetError("reset"))
    stream = ProtocolStream(reader)
    with pytest.raises(httpcore.ReadError):
        await stream.read(10, 1.0)


# --- flow control --------------------------------------------------------------------------


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


# --- TLS -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_certs(tmp_path_factory.mktemp("certs"))


def server_context(certs: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)
    return context


async def sse_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + chunked(EVENT) + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def test_https_upstream_trusted_through_ssl_cert_file(
    certs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca))
    async with (
        server(sse_once, server_context(certs)) as url,
        UpstreamClient(settings_for(url)) as client,
    ):
        assert await collect(client) == EVENT + b"data: [DONE]\n\n"
        assert await collect(client) == EVENT + b"data: [DONE]\n\n"  # a pooled connection


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


# --- the body as the relay reads it ----------------------------------------------------------


async def test_a_compressed_body_is_still_decoded() -> None:
    """We ask for identity; an upstream that gzips anyway is decoded (aiter_bytes)."""
    import gzip

    body = gzip.compress(EVENT + b"data: [DONE]\n\n")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = HEAD.replace(b"\r\n\r\n", b"\r\ncontent-encoding: gzip\r\n\r\n")
        writer.write(head + chunked(body[:10]) + chunked(body[10:]) + b"0\r\n\r\n")
        await writer.drain()

    async with server(serve) as url, UpstreamClient(settings_for(url)) as client:
        assert await collect(client) == EVENT + b"data: [DONE]\n\n"


async def test_an_identity_body_arrives_read_by_read() -> None:
    """Unencoded, each socket read reaches the relay as it came (aiter_raw)."""
    gate = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunked(EVENT))
        await writer.drain()
        await gate.wait()
        writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with (
        server(serve) as url,
        UpstreamClient(settings_for(url)) as client,
        client.stream("default", BODY) as chunks,
    ):
        received = [await anext(chunks)]
        gate.set()
        received += [chunk async for chunk in chunks]
    assert received == [EVENT, b"data: [DONE]\n\n"]


async def test_unix_socket_and_refused_connections_map_to_httpcore_errors(
    tmp_path: Any,
) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    path = str(tmp_path / "echo.sock")
    backend = ProtocolBackend()
    async with await asyncio.start_unix_server(echo, path):
        stream = await backend.connect_unix_socket(path, timeout=5)
        await stream.write(b"ping", timeout=5)
        assert await stream.read(100, timeout=5) == b"ping"
        assert await stream.read(100, timeout=5) == b""  # the server closed: EOF
        await stream.aclose()
    with pytest.raises(httpcore.ConnectError) as info:
        await backend.connect_unix_socket(path, timeout=5)  # nobody listens any more
    assert isinstance(info.value.__cause__, OSError)
