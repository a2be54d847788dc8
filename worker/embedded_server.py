"""uvicorn embedded in a running event loop: the worker's metrics and health server and
the mock upstream.

A module of its own so that importing uvicorn costs a worker's start-up only when the
endpoints are switched on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from worker import internals
from worker.aio import URGENT, mixed_in, socket_of
from worker.errors import ConfigError


class EmbeddedServer(uvicorn.Server):
    """uvicorn in a running loop: leaves the process's signals alone, stops on request.

    ``grace``: how long responses in progress may take to end at shutdown (uvicorn's own
    shutdown adds fixed 0.1 s sleeps; tests start many servers).

    Its overrides are uvicorn's internals, checked once (``worker.internals``): where they
    moved, it runs as uvicorn's own ``Server`` (public: ``serve``, ``started``,
    ``should_exit``), whose main loop wakes every 0.1 s and whose sockets do not end a
    wake-up tick's sleep."""

    def __init__(self, config: uvicorn.Config, *, name: str = "http", grace: float = 0.5) -> None:
        super().__init__(config)
        self.name = name
        self.grace = grace
        self.ready = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.own = internals.available("uvicorn-server")
        internals.available("uvicorn-capture-signals")  # (only said: nothing replaces it)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        if not self.own:
            return await super().main_loop()
        self.ready.set()
        while not self.stop_requested.is_set():
            await self.on_tick(0)  # refreshes the Date header
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_requested.wait(), 1.0)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.own:
            return await super().shutdown(sockets)
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        for _ in range(int(self.grace / 0.005)):
            if not (self.server_state.connections or self.server_state.tasks):
                break
            await asyncio.sleep(0.005)
        for task in self.server_state.tasks:
            task.cancel()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()  # the app's shutdown (a no-op with lifespan="off")

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.own:
            return await super().startup(sockets)
        protocol = self.config.http_protocol_class
        self.config.http_protocol_class = mixed_in(_UrgentConnection, protocol, "Urgent")
        await super().startup(sockets)

    async def start(self, sock: socket.socket) -> asyncio.Task[None]:
        URGENT.watch(sock)  # a request is answered at once, not at the wake-up tick's end
        task = asyncio.create_task(self.serve(sockets=[sock]), name=f"chatstream-{self.name}")
        ready = asyncio.create_task(self.ready.wait() if self.own else self._started())
        await asyncio.wait((task, ready), return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            await task  # raises the start-up error
            raise RuntimeError(f"the {self.name} server did not start")
        return task

    async def _started(self) -> None:
        while True:  # uvicorn's own flag, set when its startup is done (it has no event)
            if self.started:
                return
            await asyncio.sleep(0.005)

    def request_stop(self) -> None:
        self.stop_requested.set()
        self.should_exit = True  # (uvicorn's own main loop)


class _UrgentConnection(asyncio.Protocol):
    """Mixed into uvicorn's HTTP protocol: the connection's socket joins ``URGENT``."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        URGENT.watch(socket_of(transport))


def bind(host: str, port: int, backlog: int = 128, *, what: str = "a server") -> socket.socket:
    """A listening socket made with IPPROTO_TCP, so asyncio sets TCP_NODELAY on accepted ones
    (``socket.create_server`` leaves it off: 40 ms Nagle stalls).

    A port in use (or an address this host does not have) is a ConfigError naming ``what``
    was to listen there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"{what} cannot listen on {host}:{port}: {reason}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def served(server: EmbeddedServer, sock: socket.socket) -> AsyncIterator[int]:
    """``server`` on the listening ``sock`` until the block ends; yields the bound port."""
    try:
        task = await server.start(sock)
    except BaseException:
        sock.close()
        raise
    try:
        yield int(sock.getsockname()[1])
    finally:
        server.request_stop()
        await task
        sock.close()
