"""Stand-ins the tests put in place of the real thing: a server that never answers, the
upstream gates' clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from unittest import mock

from worker.upstream import gate as gate_module


@asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """A port that accepts connections and never answers (a wrong port, a hung proxy)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


class InstantGateWaits:
    """The upstream gates' clock and waits, replaced: a timed wait returns at once and moves
    the clock on by its length (recorded in ``waits``); an untimed one waits for real."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def wait_for_change(self, changed: asyncio.Event, timeout: float | None) -> None:
        if timeout is None:
            await changed.wait()
            return
        self.waits.append(timeout)
        self.now += max(timeout, 0.0)
        await asyncio.sleep(0)

    @contextmanager
    def installed(self) -> Iterator[InstantGateWaits]:
        with (
            mock.patch.object(gate_module, "monotonic", self.monotonic),
            mock.patch.object(gate_module, "wait_for_change", self.wait_for_change),
        ):
            yield self
