"""The gateway's limits: open streams per key and per process, jobs per minute per key.

Open streams (event streams and requests waiting for a result) are counted in the process:
they protect the process's sockets and memory. Jobs per minute are counted in Redis, so
every gateway process in front of the same Redis shares one budget per key: they protect
the upstream. Both refuse with ``LimitExceeded`` (the status and ``Retry-After`` to answer
with).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from worker.store import lua
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient


class LimitExceeded(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = max(1, math.ceil(retry_after))


class Slot:
    """One open stream's place; ``release()`` may be called any number of times."""

    def __init__(self, slots: StreamSlots, key_id: str) -> None:
        self._slots = slots
        self._key_id: str | None = key_id

    def release(self) -> None:
        if self._key_id is not None:
            self._slots.release(self._key_id)
            self._key_id = None


class StreamSlots:
    """Open streams per API key and in all; ``take()`` one for as long as it is open."""

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self.open: Counter[str] = Counter()
        self.open_total = 0

    def acquire(self, key_id: str) -> None:
        if self.open_total >= self.total:
            raise LimitExceeded(
                503,
                "overloaded",
                f"the gateway has {self.total} open streams, its limit; retry shortly",
                1,
            )
        if self.open[key_id] >= self.per_key:
            raise LimitExceeded(
                429,
                "too_many_streams",
                f"this API key has {self.per_key} open streams, its limit; close one first",
                1,
            )
        self.open[key_id] += 1
        self.open_total += 1

    def release(self, key_id: str) -> None:
        self.open[key_id] -= 1
        self.open_total -= 1
        if self.open[key_id] <= 0:
            del self.open[key_id]

    def take(self, key_id: str) -> Slot:
        self.acquire(key_id)
        return Slot(self, key_id)

    @contextmanager
    def hold(self, key_id: str) -> Iterator[None]:
        slot = self.take(key_id)
        try:
            yield
        finally:
            slot.release()


GCRA = lua.script("limits/gcra")


class RateLimiter:
    """Jobs per minute per API key, shared by every gateway process (in Redis).

    A key may create ``per_minute`` jobs at once, then one every ``60 / per_minute``
    seconds; 0 turns the limit off.
    """

    def __init__(self, redis: RedisClient, keys: Keys, per_minute: int) -> None:
        self.keys = keys
        self.per_minute = per_minute
        self._script = redis.register_script(GCRA)

    async def take(self, key_id: str) -> None:
        if self.per_minute <= 0:
            return
        interval = max(1, round(60_000 / self.per_minute))
        args = [int(time.time() * 1000), interval, 60_000 - interval]
        wait = int(await self._script(keys=[self.keys.gateway_rate(key_id)], args=args))
        if wait > 0:
            raise LimitExceeded(
                429,
                "rate_limit_exceeded",
                f"this API key may create {self.per_minute} jobs per minute; "
                f"retry in {math.ceil(wait / 1000)} s",
                wait / 1000,
            )
