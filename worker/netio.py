"""httpcore's network layer on a plain asyncio ``Protocol``: the upstream read path.

httpx stays the client (request building, redirects refused, status and error handling,
its exception types); httpcore keeps the connection pool, h11 and the TLS context. Only
the socket layer under them is replaced, through httpcore's documented extension point,
the *network backend*. The default one (anyio) costs, on every read of a streamed
response, a cancel scope with a timer (``fail_after``), a ``pause_reading`` /
``resume_reading`` of the transport and a future; here a read of data that has already
arrived returns at once, a read that must wait awaits one future, and the read timeout
is a *lazy* timer: armed once per connection when a wait begins, and on expiry either
failing a read that has waited the whole timeout or re-armed for the current wait's
deadline. With one event every 20 ms and a 60 s timeout that is one timer per minute per
connection instead of fifty per second (docs/decisions.md).

Errors are the ones httpcore's own backends raise (``ConnectError``, ``ConnectTimeout``,
``ReadError``, ``ReadTimeout``, ``WriteError``, ``WriteTimeout``), each chained to the
``OSError`` / ``ssl.SSLError`` / ``TimeoutError`` behind it, so httpx maps them exactly as
before.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpcore
import httpx

SOCKET_OPTION = (
    tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]
)
HIGH_WATER = 256 * 1024  # buffered unread bytes before the socket stops being read


class _Reader(asyncio.Protocol):
    """Buffers what arrives; ``read`` hands it out; one lazy timer for the read timeout."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []  # arrived, unread
        self.size = 0
        self.waiter: asyncio.Future[None] | None = None
        self.wait_began = 0.0
        self.wait_timeout: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        self.drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > HIGH_WATER and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close the transport (and, over TLS, the connection)

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def pause_writing(self) -> None:
        self.drain = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)
        self.drain = None

    # -- reading ------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self, max_bytes: int, timeout: float | None) -> bytes:
        if not self.chunks and not self.eof:
            await self._wait(timeout)
        if self.chunks:
            return self._take(max_bytes)
        if self.error is not None:
            raise httpcore.ReadError(self.error) from self.error
        return b""  # EOF

    def _take(self, max_bytes: int) -> bytes:
        chunks = self.chunks
        if len(chunks) == 1 and len(chunks[0]) <= max_bytes:  # the usual case: no copy
            data = chunks.pop()
        else:
            data = b"".join(chunks)
            chunks.clear()
            if len(data) > max_bytes:
                chunks.append(data[max_bytes:])
                data = data[:max_bytes]
        self.size -= len(data)
        if self.paused and self.size <= HIGH_WATER // 4 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def _wait(self, timeout: float | None) -> None:
        waiter = self.waiter = self.loop.create_future()
        self.wait_timeout = timeout
        if timeout is not None:
            self.wait_began = self.loop.time()
            self._arm(self.wait_began + timeout)
        try:
            await waiter
        finally:
            self.waiter = None

    def _arm(self, deadline: float) -> None:
        """A timer at ``deadline`` unless one already fires no later (lazy re-arming)."""
        if self.timer is not None:
            if self.timer.when() <= deadline:
                return
            self.timer.cancel()
        self.timer = self.loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.timer = None
        waiter, timeout = self.waiter, self.wait_timeout
        if waiter is None or waiter.done() or timeout is None:
            return  # no read waiting: the next wait arms a timer again
        deadline = self.wait_began + timeout
        if self.loop.time() >= deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._arm(deadline)


class ProtocolStream(httpcore.AsyncNetworkStream):
    """One connection (TCP, or TLS over it after ``start_tls``)."""

    def __init__(self, reader: _Reader) -> None:
        self._reader = reader

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return await self._reader.read(max_bytes, timeout)
        except TimeoutError as exc:
            raise httpcore.ReadTimeout(exc) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        reader = self._reader
        if not buffer:
            return
        if reader.transport is None or reader.transport.is_closing():
            error = reader.error or ConnectionResetError("the connection is closed")
            raise httpcore.WriteError(error) from error
        reader.transport.write(buffer)
        if reader.drain is not None:
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(reader.drain)
            except TimeoutError as exc:
                raise httpcore.WriteTimeout(exc) from exc
            if reader.error is not None:
                raise httpcore.WriteError(reader.error) from reader.error

    async def aclose(self) -> None:
        transport = self._reader.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        reader = self._reader
        assert reader.transport is not None
        try:
            async with asyncio.timeout(timeout):
                transport = await reader.loop.start_tls(
                    reader.transport, reader, ssl_context, server_hostname=server_hostname
                )
        except TimeoutError as exc:
            await self.aclose()
            raise httpcore.ConnectTimeout(exc) from exc
        except (OSError, ssl.SSLError) as exc:
            await self.aclose()
            raise httpcore.ConnectError(exc) from exc
        if transport is None:
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        reader.transport = transport
        return self

    def get_extra_info(self, info: str) -> Any:
        reader = self._reader
        transport = reader.transport
        if info == "is_readable":  # an idle pooled connection that the server closed
            return reader.eof or bool(reader.chunks)
        if transport is None:
            return None
        name = {"client_addr": "sockname", "server_addr": "peername"}.get(info, info)
        if name in ("ssl_object", "sockname", "peername", "socket"):
            return transport.get_extra_info(name)
        return None


class ProtocolBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend on ``loop.create_connection`` (asyncio or uvloop)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        local = (local_address, 0) if local_address else None
        return await _connect(
            lambda loop, reader: loop.create_connection(
                lambda: reader, host, port, local_addr=local
            ),
            timeout,
            socket_options,
        )

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return await _connect(
            lambda loop, reader: loop.create_unix_connection(lambda: reader, path),
            timeout,
            socket_options,
        )

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


Opener = Callable[
    [asyncio.AbstractEventLoop, _Reader], Awaitable[tuple[asyncio.BaseTransport, Any]]
]


async def _connect(
    open_connection: Opener, timeout: float | None, options: Iterable[SOCKET_OPTION] | None
) -> ProtocolStream:
    """Open a connection for a new reader, with httpcore's connect errors."""
    reader = _Reader()
    try:
        async with asyncio.timeout(timeout):
            await open_connection(asyncio.get_running_loop(), reader)
    except TimeoutError as exc:
        raise httpcore.ConnectTimeout(exc) from exc
    except OSError as exc:
        raise httpcore.ConnectError(exc) from exc
    _set_options(reader, options)
    return ProtocolStream(reader)


def _set_options(reader: _Reader, options: Iterable[SOCKET_OPTION] | None) -> None:
    if not options or reader.transport is None:
        return
    sock: socket.socket = reader.transport.get_extra_info("socket")
    for option in options:
        sock.setsockopt(*option)


def use_protocol_backend(client: httpx.AsyncClient) -> bool:
    """Put :class:`ProtocolBackend` under every connection pool of ``client``.

    httpx builds its transports (TLS context, limits, proxies from the environment) as
    usual; only the pools' network backend is swapped. Returns False, changing nothing,
    if this httpx/httpcore does not have the attributes this relies on.
    """
    transports = [client._transport, *client._mounts.values()]
    pools = [getattr(t, "_pool", None) for t in transports if t is not None]
    if not pools or not all(isinstance(p, httpcore.AsyncConnectionPool) for p in pools):
        return False
    if not all(hasattr(pool, "_network_backend") for pool in pools):
        return False
    backend = ProtocolBackend()
    for pool in pools:
        pool._network_backend = backend  # type: ignore[union-attr]
    return True
