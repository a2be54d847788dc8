"""The dashboard's state: settings, Redis, the operators' keys, the read loop and its caches.

It keeps nothing Redis does not have: the caches below are copies (activity minutes that no
longer change, the tenants of the newest dead letters), so a restart loses nothing. Every
JSON answer goes through ``encode``, which masks the process's configured secrets (upstream
and gateway keys, the dashboard's keys, the Redis password) should any value hold one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request

from worker.aio import cancel_and_wait
from worker.client import Client
from worker.dashboard.live import Live
from worker.dashboard.overview import Slow, build, tenant_rows
from worker.gateway.auth import ApiKey, ApiKeys, parse_keys
from worker.gateway.hub import EventHub, event_hub
from worker.logs import RedactFilter, secrets_of
from worker.settings import Settings
from worker.store.activity import ActivityLog
from worker.store.fleet import Fleet, FleetReader, Waiting
from worker.store.records import as_text
from worker.store.redis_client import RedisClient, redis_from_settings

log = logging.getLogger("chatstream.dashboard")

KEY_HEADER = "x-chatstream-dashboard-key"
INTERVAL = 1.0  # seconds between reads while a page listens
SLOW_EVERY = 5  # reads: the dead letters and the activity this often
TENANTS_PER_READ = 50  # waiting tenants of a shard broken down by priority per read
DEAD_SAMPLE = 1_000  # the newest dead letters whose tenants the overview counts
DAY = 1_440  # minutes of activity kept in memory at most (the counters' own bound)


@dataclass(slots=True)
class Pass:
    """One shard's breakdown of waiting jobs by tenant and priority under way: a script call
    per read for ``TENANTS_PER_READ`` tenants (about nine calls each), so no call holds
    Redis long; a finished pass replaces the shown one."""

    started: float
    start: int = 0
    found: dict[str, Waiting] = field(default_factory=dict)


class Dashboard:
    def __init__(self, settings: Settings, redis: RedisClient | None = None) -> None:
        self.settings = settings
        self.owns_redis = redis is None
        self.redis = redis if redis is not None else redis_from_settings(settings)
        self.client = Client.from_settings(settings, self.redis)
        self.keys = self.client.keys
        self.operators = ApiKeys(parse_keys(settings.dashboard_keys, "CHATSTREAM_DASHBOARD_KEYS"))
        self.fleet = FleetReader(self.redis, self.keys)
        self.activity = ActivityLog(self.redis, self.keys)
        self.slow = Slow()
        self.latest: Fleet | None = None
        self.live = Live(self.read, self._failed, INTERVAL)
        self._redact = RedactFilter(secrets_of(settings)).redact
        self._hub: EventHub | None = None
        self._hub_task: asyncio.Task[None] | None = None
        self._dead_tenant: dict[str, str] = {}  # job id -> tenant, of the dead letters sampled
        self._dead_stale = False
        self._passes: dict[int, Pass] = {}

    # -- who is asking --------------------------------------------------------------------

    def operator(self, request: Request) -> ApiKey | None:
        """The operator's key sent in ``X-Chatstream-Dashboard-Key`` (constant time), or None."""
        presented = request.headers.get(KEY_HEADER)
        return self.operators.check(presented) if presented else None

    # -- answers --------------------------------------------------------------------------

    def encode(self, value: Any) -> bytes:
        """JSON with every configured secret masked."""
        return self._redact(json.dumps(value, separators=(",", ":"), allow_nan=False)).encode()

    def _failed(self, reason: str) -> bytes:
        return self.encode({"error": reason})

    @property
    def hub(self) -> EventHub:
        """The gateway's event hub for job pages' live replies, started on first use."""
        if self._hub is None:
            self._hub = event_hub(self.redis, self.keys)
            self._hub_task = asyncio.create_task(self._hub.run(), name="chatstream-dashboard-hub")
        return self._hub

    # -- the read loop ----------------------------------------------------------------------

    async def read(self, tick: int) -> bytes:
        """One read of the fleet (the loop's ``tick``-th): the overview, encoded."""
        fleet = await self.fleet.read_shards()
        use = await self.fleet.read_use(fleet)
        targets = await self.fleet.read_targets(fleet)
        await self._read_waiting(fleet)
        if tick % SLOW_EVERY == 0:
            await self._read_minutes(int(fleet.now // 60))
        if tick % SLOW_EVERY == 0 or self._dead_stale:
            self._dead_stale = False
            await self._read_dead_letters()
        self.latest = fleet
        overview = build(fleet, use, self.slow, self.settings.heartbeat_timeout, targets)
        return self.encode(overview)

    async def _read_waiting(self, fleet: Fleet) -> None:
        """The next chunk of each shard's pass over its waiting tenants."""
        for shard in fleet.shards:
            step = self._passes.setdefault(shard.index, Pass(fleet.now))
            found = await self.fleet.read_waiting(shard.index, step.start, TENANTS_PER_READ)
            step.found.update(found)
            step.start += TENANTS_PER_READ
            if len(found) < TENANTS_PER_READ:  # the pass is complete
                self.slow.waiting[shard.index] = step.found
                self.slow.waiting_at[shard.index] = step.started
                del self._passes[shard.index]

    async def _read_minutes(self, minute: int, span: int = 60) -> None:
        """The last ``span`` minutes: the two newest always (workers still add to them), the
        others once."""
        wanted = [m for m in range(minute - span + 1, minute + 1)
                  if m >= minute - 1 or m not in self.slow.minutes]  # fmt: skip
        self.slow.minutes.update(await self.activity.read(wanted))
        for old in [m for m in self.slow.minutes if m <= minute - DAY]:
            del self.slow.minutes[old]

    async def minutes(self, span: int) -> dict[int, dict[str, int]]:
        """The activity of the last ``span`` minutes (up to a day), read where not cached."""
        fleet = self.latest or await self.fleet.read_shards()
        minute = int(fleet.now // 60)
        await self._read_minutes(minute, min(max(span, 1), DAY))
        return {m: c for m, c in self.slow.minutes.items() if m > minute - span}

    async def _read_dead_letters(self) -> None:
        """The tenants of the newest ``DEAD_SAMPLE`` dead letters (records read once)."""
        rows: Any = await self.redis.xrevrange(self.keys.dead, count=DEAD_SAMPLE)
        jobs = [as_text(fields.get("job", "")) for _, fields in rows]
        unseen = [job for job in dict.fromkeys(jobs) if job and job not in self._dead_tenant]
        if unseen:
            pipe = self.redis.pipeline(transaction=False)
            for job in unseen:
                pipe.hget(self.keys.job(job), "tenant")
            for job, tenant in zip(unseen, await pipe.execute(), strict=True):
                self._dead_tenant[job] = as_text(tenant) if tenant else "?"
        present = set(jobs)
        self._dead_tenant = {j: t for j, t in self._dead_tenant.items() if j in present}
        counts: dict[str, int] = {}
        for job in jobs:
            tenant = self._dead_tenant.get(job, "?")
            counts[tenant] = counts.get(tenant, 0) + 1
        self.slow.dead_tenants, self.slow.dead_seen = counts, len(jobs)

    def dead_changed(self) -> None:
        """A dead letter was requeued or deleted here: the next read counts them again."""
        self._dead_stale = True

    async def tenants(self) -> list[dict[str, Any]]:
        """Every tenant's row, from the latest read (one read when there is none)."""
        if self.latest is None:
            await self.live.current()
        assert self.latest is not None
        return tenant_rows(self.latest, self.slow)

    # -- life -------------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> Any:
        try:
            yield
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Stop the read loop and the hub; close Redis if the dashboard made the client.
        An application that mounts the dashboard calls this from its own lifespan."""
        await self.live.close()
        if self._hub is not None and self._hub_task is not None:
            await cancel_and_wait([self._hub_task])
            await self._hub.close()
            self._hub = None
        if self.owns_redis:
            await self.redis.aclose()
