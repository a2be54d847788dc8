"""Heartbeats: which workers are alive, separate from the leases on their jobs.

Every ``CHATSTREAM_HEARTBEAT_SECONDS`` a worker sets its score in ``<prefix>:workers`` to the
Redis server's clock (one script: no clock skew between machines) and gets back the workers
whose score is older than ``CHATSTREAM_HEARTBEAT_TIMEOUT``: they stopped (SIGKILL, the OOM
killer, a lost machine, or a process frozen that long). The runner then takes their queue
entries over at once, instead of waiting for their leases to expire (docs/decisions.md).

A worker judges others only after its own heartbeats have been on time for the whole
timeout. A beat that failed is a break, and so is a beat that succeeded more than the timeout
after the previous success: one that hung through a network partition until redis-py's retry
got it through, or the first after the event loop stalled. After Redis was unreachable for
everyone (a restart, a failover, a partition) every worker's last heartbeat is old; this gives
the live ones time to beat again (they retry every second at most) before anyone is declared
dead. A worker whose own score had been removed (declared dead after a stall) learns it from
its next heartbeat (``fresh``).

The heartbeat script is flagged ``allow-oom`` where the server knows script flags (Redis 7):
at ``maxmemory`` a heartbeat still lands (it only updates a score), so a Redis refusing
writes does not make live workers look dead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from worker.store import lua
from worker.store.keys import Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

log = logging.getLogger("chatstream.worker")

MAX_DEAD = 100  # dead workers reported per heartbeat

BEAT = lua.script("liveness/beat")
ALLOW_OOM = "#!lua flags=allow-oom\n"

FORGET = lua.script("liveness/forget")


@dataclass(frozen=True, slots=True)
class Beat:
    """What one heartbeat learned."""

    fresh: bool  # this worker was not in the set: first beat, or it had been declared dead
    dead: list[str] = field(default_factory=list)  # empty while this worker may not judge


class Liveness:
    def __init__(self, redis: RedisClient, keys: Keys, name: str, timeout: float) -> None:
        self.redis = redis
        self.keys = keys
        self.name = name
        self.timeout = timeout
        self._beat = redis.register_script(ALLOW_OOM + BEAT)
        self._forget = redis.register_script(FORGET)
        self._beating_since: float | None = None  # monotonic; None after a failed beat
        self._last_beat = 0.0  # monotonic, when the last successful beat returned

    async def load(self) -> None:
        """Use the ``allow-oom`` flag if the server runs flagged scripts (Redis 7; not Redis
        6, nor fakeredis, which loads such a script but cannot run it)."""
        try:
            await self.redis.eval(ALLOW_OOM + "return 1", 0)
        except ResponseError:
            self._beat = self.redis.register_script(BEAT)

    async def beat(self, info: str = "") -> Beat:
        """Write this worker's heartbeat (and ``info``, what it reports about itself: JSON);
        the workers it may declare dead."""
        try:
            reply: Any = await self._beat(
                keys=[self.keys.workers, self.keys.workers_info],
                args=[self.name, self.timeout, MAX_DEAD, info],
            )
        except BaseException:
            self._beating_since = None
            raise
        now = time.monotonic()
        if self._beating_since is None or now - self._last_beat > self.timeout:
            self._beating_since = now  # a break: on time again from this beat on
        self._last_beat = now
        judging = now - self._beating_since >= self.timeout
        dead = [as_text(name) for name in reply[1] if as_text(name) != self.name]
        return Beat(int(reply[0]) == 1, dead if judging else [])

    async def forget(self, name: str) -> bool:
        """Remove a dead worker from the set (it holds no more entries)."""
        keys = [self.keys.workers, self.keys.workers_info]
        return int(await self._forget(keys=keys, args=[name, self.timeout])) == 1

    async def leave(self) -> None:
        await self.redis.zrem(self.keys.workers, self.name)
        await self.redis.hdel(self.keys.workers_info, self.name)
