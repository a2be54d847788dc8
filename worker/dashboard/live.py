"""One read loop per dashboard process, whatever the number of open pages.

While at least one page listens, one task reads the fleet every ``interval`` seconds and
hands the same encoded overview to every listener; with none, nothing is read (the loop
stops ``linger`` seconds after the last one left, so a reload does not restart it). A
listener keeps only the newest overview it has not taken yet: a slow page skips to the
latest instead of holding the loop or piling up memory. A request for the overview now
(``current``) gets the loop's last one while it is fresh, else shares one read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.exceptions import RedisError

from worker.aio import cancel_and_wait

log = logging.getLogger("chatstream.dashboard")

Read = Callable[[int], Awaitable[bytes]]  # tick number -> the encoded overview


class Listener:
    """One page's place: the newest overview not taken yet."""

    def __init__(self) -> None:
        self.latest: bytes | None = None
        self.ready = asyncio.Event()

    def offer(self, payload: bytes) -> None:
        self.latest = payload
        self.ready.set()

    async def take(self) -> bytes:
        await self.ready.wait()
        self.ready.clear()
        payload, self.latest = self.latest or b"", None
        return payload


class Live:
    def __init__(
        self, read: Read, failed: Callable[[str], bytes], interval: float, linger: float = 5.0
    ) -> None:
        self.read = read
        self.failed = failed  # the payload that says why a read failed
        self.interval = interval
        self.linger = linger
        self.listeners: set[Listener] = set()
        self.reads = 0  # reads of the fleet since start (for tests and /healthz)
        self._task: asyncio.Task[None] | None = None
        self._last: tuple[float, bytes] | None = None  # (loop time, payload)
        self._reading: asyncio.Task[bytes] | None = None

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[Listener]:
        """A listener fed by the loop (started if it was not running) until the block ends."""
        listener = Listener()
        self.listeners.add(listener)
        if self._last is not None:
            listener.offer(self._last[1])
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="chatstream-dashboard-live")
        try:
            yield listener
        finally:
            self.listeners.discard(listener)

    async def current(self) -> bytes:
        """The overview as of at most one interval ago."""
        loop = asyncio.get_running_loop()
        if self._last is not None and loop.time() - self._last[0] < self.interval:
            return self._last[1]
        return await self._read_shared(self.reads)

    async def _read_shared(self, tick: int) -> bytes:
        """One read at a time; callers that come while it runs share its result."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read_once(tick))
        reading = self._reading
        try:
            return await asyncio.shield(reading)
        finally:
            if reading.done() and self._reading is reading:
                self._reading = None

    async def _read_once(self, tick: int) -> bytes:
        try:
            payload = await self.read(tick)
        except (RedisError, OSError) as exc:
            log.warning("dashboard: reading the fleet failed: %s", exc)
            return self.failed(f"Redis: {exc}")
        self.reads += 1
        self._last = (asyncio.get_running_loop().time(), payload)
        return payload

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        tick, idle_since = 0, None
        while True:
            if self.listeners:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since >= self.linger:
                return
            began = loop.time()
            if self.listeners:
                payload = await self._read_shared(tick)
                tick += 1
                for listener in list(self.listeners):
                    listener.offer(payload)
            await asyncio.sleep(max(self.interval - (loop.time() - began), 0.05))

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        if self._reading is not None:
            await cancel_and_wait([self._reading])
