"""A worker's slots: at most ``concurrency`` jobs run at once.

A job waiting for an upstream that is down gives its slot back meanwhile and takes one
again when its turn comes; up to ``max_waiting`` jobs may wait so, beyond the running ones.
The consumer reads no more entries than :meth:`Slots.capacity` allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from worker.service.entries import HeldEntry


class Slots:
    def __init__(self, concurrency: int, max_waiting: int) -> None:
        self.concurrency = concurrency
        self.max_waiting = max_waiting
        self.waiting = 0  # jobs waiting for a down upstream, without a slot
        self._semaphore = asyncio.Semaphore(concurrency)
        self._freed = asyncio.Event()

    def capacity(self, held: int) -> int:
        """Entries the worker may take now, holding ``held``: its free slots (jobs waiting
        for a down upstream hold none), and no more than ``concurrency + max_waiting``."""
        free = self.concurrency - (held - self.waiting)
        return max(0, min(free, self.concurrency + self.max_waiting - held))

    async def wait_for_capacity(self, held: Callable[[], int]) -> int:
        while (free := self.capacity(held())) <= 0:
            self._freed.clear()
            await self._freed.wait()
        return free

    def freed(self) -> None:
        """An entry is no longer held: a reader waiting for capacity may go on."""
        self._freed.set()

    async def take(self, entry: HeldEntry) -> None:
        await self._semaphore.acquire()
        entry.holds_slot = True

    def give_back(self, entry: HeldEntry) -> None:
        if entry.holds_slot:
            entry.holds_slot = False
            self._semaphore.release()

    def without_slot(self, entry: HeldEntry) -> Callable[[], AbstractAsyncContextManager[None]]:
        """The job's ``idle``: its slot is free while it waits for a down upstream, and taken
        back (waiting for one if need be) when its turn comes. Cancelled, it takes none."""

        @asynccontextmanager
        async def idle() -> AsyncIterator[None]:
            self.give_back(entry)
            entry.waiting = True
            self.waiting += 1
            self._freed.set()
            try:
                yield
            finally:
                entry.waiting = False
                self.waiting -= 1
            await self.take(entry)

        return idle
