"""A TCP proxy between workers and Redis that a test partitions: ``pause`` stops forwarding
both ways and keeps every connection open (bytes wait in the proxy and the kernel, as in a
network that drops packets), ``resume`` forwards what waited and goes on, ``reset`` closes
every connection with a TCP reset and forwards again for new ones.

    async with TcpProxy.serving("127.0.0.1", redis_port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        proxy.pause(); ...; proxy.reset()

A connection accepted while paused reaches the target only once forwarding resumes. A
side that closes while paused is closed on the other side only after what it sent before
closing was forwarded (so Redis still runs a command whose client gave up on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

CHUNK = 64 * 1024


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections = 0  # accepted so far
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    @asynccontextmanager
    async def serving(cls, target_host: str, target_port: int) -> AsyncIterator[TcpProxy]:
        proxy = cls(target_host, target_port)
        proxy._server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        proxy.port = proxy._server.sockets[0].getsockname()[1]
        try:
            yield proxy
        finally:
            await proxy.close()

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    def pause(self) -> None:
        """Stop forwarding, both ways, on every connection; keep them all open."""
        self._flowing.clear()

    def resume(self) -> None:
        """Forward what waited, and everything from now on."""
        self._flowing.set()

    def reset(self) -> None:
        """Close every connection, both sides, with a TCP reset; then forward again."""
        for writer in list(self._writers):
            _abort(writer)
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        self._flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        target_w: asyncio.StreamWriter | None = None
        try:
            await self._flowing.wait()
            target_r, target_w = await asyncio.open_connection(*self.target)
            self._writers.add(target_w)
            await asyncio.gather(
                self._pump(client_r, target_w),
                self._pump(target_r, client_w),
                return_exceptions=True,
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._tasks.discard(task)
            for writer in (client_w, target_w):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: what arrives is held while paused, then written in order; the
        end of the stream is passed on after everything before it."""
        try:
            while True:
                data = await reader.read(CHUNK)
                await self._flowing.wait()
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(OSError):
                writer.close()
            self._writers.discard(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), not a FIN: the peer's next read fails at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
