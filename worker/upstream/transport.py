"""An httpx transport on asyncio protocols and httptools (llhttp, the parser uvicorn uses).

httpx stays the client (request building, redirects refused, status and error handling, its
exception types); this replaces what is under it, through httpx's documented extension
point (``AsyncBaseTransport``): httpcore's pool, h11 and the socket layer. Per read of a
streamed response the work is llhttp in C (``data_received`` -> ``feed_data`` -> one
``on_body`` callback), a list append and, when the relay is waiting, one future; where
httpcore + h11 run some twenty Python frames per read (docs/decisions.md, 39).

What it does, HTTP/1.1 only: keep-alive pooling (``httpx.Limits``: connections in use,
idle ones kept, their expiry), TLS (httpx's own SSL context, so ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` are honoured), httpx's four timeouts (connect, read, write, pool), flow
control of large bodies, and httpx's exception types, each chained to the ``OSError`` /
``ssl.SSLError`` behind it so ``worker.upstream.client`` tells failures apart as before. The read
timeout costs no timer per read: a read that must wait records when it began, and one
sweep per transport (every tenth of the read timeout, only while connections are in use)
fails the reads that have waited the whole timeout. Proxies are not spoken here:
``worker.upstream.client`` uses httpx's own transport when the environment configures one.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httptools
import httpx

from worker.aio import URGENT, socket_of
from worker.upstream import BODY_EXTENSION

HIGH_WATER = 256 * 1024  # buffered unread body bytes before the socket stops being read
SWEEPS_PER_TIMEOUT = 10  # a stalled read fails within 1.1 x its read timeout
MIN_SWEEP, MAX_SWEEP = 0.01, 1.0  # seconds between sweeps
NO_RESPONSE = "Server disconnected without sending a response."
CUT_BODY = "peer closed connection without sending complete message body"
Key = tuple[str, str, int]  # scheme, host, port
Consume = Callable[[bytes], bool]  # takes one read of the body; True: stop reading
# reads of a body handled at once, before the rest wait for the wake-up tick (URGENT): the
# first byte (often a chunk with the role alone) and the read after it (the first token)
URGENT_BODY_READS = 2


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, one response at a time; httptools calls back into it."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False  # connection lost (or closed by us)
        self.error: BaseException | None = None
        self.drain: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.busy = False  # carrying a request (else data from the server is a protocol error)
        self.urgent_reads = 0  # body reads left before the socket leaves URGENT
        self._reset()

    def _reset(self) -> None:
        """Ready for the next response on this connection."""
        self.headers: list[tuple[bytes, bytes]] = []
        self.reason = b""
        self.headers_done = False
        self.complete = False  # the whole message arrived
        self.keep_alive = False  # ... and neither side asked to close the connection
        self.informational = False  # a 1xx response before the real one
        self.chunks: list[bytes] = []  # arrived, unread
        self.size = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.wait_began = 0.0
        self.read_timeout: float | None = None
        self.consume: Consume | None = None  # fed each read as it arrives (_Body.feed)
        self.consume_error: Exception | None = None  # what ``consume`` raised

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # nothing asked for: this connection cannot be trusted any more
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {exc}"), exc)
            self.close()
            return
        if self.urgent_reads and self.chunks:
            self._count_urgent_read()
        if self.consume is not None and self.chunks:
            self._feed_consumer()
            return
        if self.size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def _count_urgent_read(self) -> None:
        self.urgent_reads -= 1
        if not self.urgent_reads:
            URGENT.forget(socket_of(self.transport))

    def eof_received(self) -> bool:
        return False  # close the transport (and, over TLS, the connection)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.complete and exc is None and self._ends_at_close():
            self.complete = True  # a body delimited by the end of the connection
        elif not self.complete and self.error is None:
            self.error = _lost(exc, self.headers_done)
        self._wake()
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)

    def pause_writing(self) -> None:
        self.drain = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)
        self.drain = None

    # -- httptools callbacks ------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        code = self.parser.get_status_code()
        if 100 <= code < 200 and code != 101:  # 100 Continue and the like: not the answer
            self.informational = True
            self.headers, self.reason = [], b""
            return
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.size += len(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # (llhttp resets it after this)

    # -- the request's side ---------------------------------------------------------------

    def _fail(self, error: httpx.TransportError, cause: BaseException) -> None:
        error.__cause__ = cause
        self.error = error
        self._wake()

    def _feed_consumer(self) -> None:
        """Hand what arrived to ``consume`` now, in this callback: the reading task is not
        woken for a read, only when the body ends, fails or ``consume`` stops it."""
        assert self.consume is not None
        self.wait_began = self.loop.time()  # the read timeout counts from the last read
        try:
            stop = self.consume(self.take())
        except Exception as exc:  # raised in the reading task, by _Body.feed
            self.consume_error, stop = exc, True
        if stop:
            self.consume = None
        if stop or self.complete or self.error is not None:
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _ends_at_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    async def wait(self) -> None:
        """Until more arrives, the message ends or fails; the sweep enforces the timeout."""
        waiter = self.waiter = self.loop.create_future()
        self.wait_began = self.loop.time()
        try:
            await waiter
        finally:
            self.waiter = None

    def expire(self, now: float) -> None:
        """Fail the waiting read if it has waited the whole read timeout (the sweep)."""
        waiter, timeout = self.waiter, self.read_timeout
        if waiter is None or waiter.done() or timeout is None:
            return
        if now - self.wait_began >= timeout:
            cause = TimeoutError(f"no data for {timeout:g}s")
            error = httpx.ReadTimeout(str(cause))
            error.__cause__ = cause
            waiter.set_exception(error)

    def take(self) -> bytes:
        """What arrived and was not read yet, as one bytes object."""
        chunks = self.chunks
        data = chunks.pop() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def kept_alive(self) -> bool:
        """The response ended whole and neither side asked to close the connection."""
        return self.complete and self.keep_alive and not self.closed

    def reusable(self, now: float, expiry: float | None) -> bool:
        """An idle connection that can carry the next request."""
        if self.closed or self.error is not None or self.transport is None:
            return False
        if self.transport.is_closing():
            return False
        return expiry is None or now - self.idle_since < expiry

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    async def send(self, head: bytes, body: bytes, timeout: float | None) -> None:
        self._reset()
        transport = self.transport
        if transport is None or transport.is_closing() or self.closed:
            cause = self.error or ConnectionResetError("the connection is closed")
            raise _chained(httpx.WriteError, "the connection is closed", cause)
        self.busy = True
        URGENT.watch(socket_of(transport))  # the response's head is handled at once
        self.urgent_reads = URGENT_BODY_READS
        transport.write(head + body)
        if self.drain is not None:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self.drain)
            except TimeoutError as exc:
                raise httpx.WriteTimeout("writing the request timed out") from exc

    async def response_head(self, read_timeout: float | None) -> None:
        self.read_timeout = read_timeout
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise httpx.RemoteProtocolError(NO_RESPONSE)
            await self.wait()


def _lost(exc: Exception | None, headers_done: bool) -> httpx.TransportError:
    """The error a read sees when the connection is gone before the message ended."""
    if exc is not None:
        return _chained(httpx.ReadError, str(exc) or type(exc).__name__, exc)
    return httpx.RemoteProtocolError(CUT_BODY if headers_done else NO_RESPONSE)


def _chained(
    kind: type[httpx.TransportError], message: str, cause: BaseException
) -> httpx.TransportError:
    error = kind(message)
    error.__cause__ = cause
    return error


class _Sweeper:
    """One timer per transport that fails the reads waiting longer than their timeout."""

    def __init__(self) -> None:
        self.active: set[_Connection] = set()  # connections carrying a response
        self.timer: asyncio.TimerHandle | None = None
        self.interval = MAX_SWEEP

    def add(self, connection: _Connection, read_timeout: float | None) -> None:
        self.active.add(connection)
        if read_timeout is not None:
            interval = min(MAX_SWEEP, max(MIN_SWEEP, read_timeout / SWEEPS_PER_TIMEOUT))
            if self.timer is None or interval < self.interval:
                self.interval = interval
                self._arm(connection.loop)

    def discard(self, connection: _Connection) -> None:
        self.active.discard(connection)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = loop.call_later(self.interval, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        if not self.active:
            self.interval = MAX_SWEEP
            return
        now = loop.time()
        for connection in list(self.active):
            connection.expire(now)
        self._arm(loop)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@dataclass(slots=True)
class _Timeouts:
    connect: float | None
    read: float | None
    write: float | None
    pool: float | None

    @classmethod
    def of(cls, request: httpx.Request) -> _Timeouts:
        given: dict[str, float | None] = request.extensions.get("timeout", {})
        return cls(given.get("connect"), given.get("read"), given.get("write"), given.get("pool"))


class HttptoolsTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=HttptoolsTransport(limits=...))``."""

    def __init__(
        self,
        *,
        limits: httpx.Limits | None = None,
        verify: ssl.SSLContext | bool = True,
        trust_env: bool = True,
    ) -> None:
        limits = limits or httpx.Limits()
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._slots = asyncio.Semaphore(limits.max_connections or 1 << 30)
        self._ssl = httpx.create_ssl_context(verify=verify, trust_env=trust_env)
        self._ssl.set_alpn_protocols(["http/1.1"])
        self._idle: list[_Connection] = []  # most recently used last
        self._expiring: asyncio.TimerHandle | None = None  # closes idle ones past the expiry
        self._sweeper = _Sweeper()
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = _key(request.url)
        timeouts = _Timeouts.of(request)
        head, body = _head(request), await _body(request)
        await self._acquire(timeouts.pool)
        connection: _Connection | None = None
        try:
            connection = await self._connection(key, timeouts.connect)
            self._sweeper.add(connection, timeouts.read)
            await connection.send(head, body, timeouts.write)
            await connection.response_head(timeouts.read)
        except BaseException:
            self._release(connection, reuse=False)
            raise
        stream = _Body(self, connection)
        return httpx.Response(
            connection.parser.get_status_code(),
            headers=connection.headers,
            stream=stream,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": connection.reason,
                BODY_EXTENSION: stream,
            },
        )

    async def aclose(self) -> None:
        self._closed = True
        self._sweeper.close()
        if self._expiring is not None:
            self._expiring.cancel()
            self._expiring = None
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    # -- the pool -------------------------------------------------------------------------

    async def _acquire(self, timeout: float | None) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(timeout):
                await self._slots.acquire()
        except TimeoutError as exc:
            raise httpx.PoolTimeout("no free connection in time") from exc

    async def _connection(self, key: Key, timeout: float | None) -> _Connection:
        now = asyncio.get_running_loop().time()
        self._close_expired(now)
        for index in range(len(self._idle) - 1, -1, -1):
            connection = self._idle[index]
            if connection.key != key:
                continue
            del self._idle[index]
            if connection.reusable(now, self._expiry):
                return connection
            connection.close()
        return await _connect(key, self._ssl, timeout)

    def _release(self, connection: _Connection | None, *, reuse: bool) -> None:
        """The request is over: the connection is kept for the next one or closed."""
        self._slots.release()
        if connection is None:
            return
        self._sweeper.discard(connection)
        connection.busy = False
        if reuse and not self._closed and connection.kept_alive():
            connection.idle_since = connection.loop.time()
            self._idle.append(connection)
            if self._max_idle is not None and len(self._idle) > self._max_idle:
                self._idle.pop(0).close()
            self._close_expired(connection.idle_since)
        else:
            connection.close()

    def _close_expired(self, now: float) -> None:
        """Close the idle connections past the expiry (or closed by the server), oldest
        first; while some are idle, one timer comes back when the oldest expires. Without
        it a server that keeps connections open longer than our expiry left a burst's
        connections open (up to ``max_keepalive_connections``) until they were reused."""
        idle = self._idle
        while idle and not idle[0].reusable(now, self._expiry):
            idle.pop(0).close()
        if idle and self._expiry is not None and self._expiring is None and not self._closed:
            loop = idle[0].loop
            self._expiring = loop.call_at(idle[0].idle_since + self._expiry, self._expire)

    def _expire(self) -> None:
        self._expiring = None
        if self._idle:
            self._close_expired(self._idle[0].loop.time())


class _Body(httpx.AsyncByteStream):
    """The response body as it arrives, one bytes object per read: iterated (httpx's way),
    or fed to a callback from the connection's own (``feed``)."""

    def __init__(self, transport: HttptoolsTransport, connection: _Connection) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        while True:
            if connection.chunks:
                yield connection.take()
            elif connection.complete:
                return
            elif connection.error is not None:
                raise connection.error
            else:
                await connection.wait()

    async def feed(self, consume: Consume) -> None:
        """``consume(data)`` for each read not iterated yet, called from the connection's
        data callback as it arrives, until ``consume`` returns True or the body ends;
        raises what ``consume`` raised, or the body's error. The caller sleeps through the
        reads: one wake-up per body instead of one (and a future) per read."""
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        if connection.chunks and consume(connection.take()):
            return
        connection.consume, connection.consume_error = consume, None
        try:
            while connection.consume is not None:
                if connection.complete and not connection.chunks:
                    return
                if connection.error is not None:
                    raise connection.error
                await connection.wait()
            error, connection.consume_error = connection.consume_error, None
            if error is not None:
                raise error
        finally:
            connection.consume = None

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            reuse = connection.complete and not connection.chunks
            self._transport._release(connection, reuse=reuse)


async def _connect(key: Key, context: ssl.SSLContext, timeout: float | None) -> _Connection:
    scheme, host, port = key
    loop = asyncio.get_running_loop()
    connection = _Connection(key)
    tls: dict[str, Any] = {"ssl": context, "server_hostname": host} if scheme == "https" else {}
    try:
        async with asyncio.timeout(timeout):
            with URGENT.hurry():  # connect and TLS handshake: hops the tick must not slow
                await loop.create_connection(lambda: connection, host, port, **tls)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
    except OSError as exc:  # ssl.SSLError and socket.gaierror are OSErrors too
        raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
    return connection


def _key(url: httpx.URL) -> Key:
    if url.scheme not in ("http", "https"):
        raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
    if not url.host:
        raise httpx.UnsupportedProtocol(f"no host in the URL {url}")
    return url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80)


def _head(request: httpx.Request) -> bytes:
    if request.method == "HEAD":  # llhttp would wait for the body the headers announce
        raise httpx.UnsupportedProtocol("HEAD requests are not supported by this transport")
    lines = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        lines += [name, b": ", value, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


async def _body(request: httpx.Request) -> bytes:
    """The request body, framed as its headers say (chunked when its length is unknown)."""
    if "content-length" in request.headers or "transfer-encoding" not in request.headers:
        return await request.aread()
    parts = [b"%x\r\n%s\r\n" % (len(part), part) async for part in _parts(request) if part]
    return b"".join([*parts, b"0\r\n\r\n"])


async def _parts(request: httpx.Request) -> AsyncIterator[bytes]:
    stream = request.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    async for part in stream:
        yield part
