"""The fleet as the dashboard reads it: each queue shard, its tenants, its upstreams' limits
and their use, the workers. Reads only, in a few pipelined round trips whatever the number
of tenants or jobs (docs/dashboard.md says what each costs):

``read_shards``
    per shard: the stream's length, its group (pending, last delivered id), its entries
    (``XRANGE``, at most ``MOST_ENTRIES``: the jobs running and those about to, each with
    its tenant and upstream), pending entries per consumer, the scheduler's counts (waiting
    per tenant and upstream), its configuration (limits as this shard's share) and paused
    upstreams; the dead letters' count, the workers' heartbeats and reports, Redis's clock.
``read_use``
    per limited upstream and shard: permits renewed within a lease, requests and tokens of
    the last minute (as the scheduler counts them), the time left of a 429's pause.
``read_targets``
    the fleet's breaker of every published route's target (shard 0's copy): down until
    when, since when, why, a probe trying it, whether it answered lately.
``read_waiting``
    a read-only script (``sched/waiting.lua``) on one shard: ``count`` waiting tenants'
    jobs by priority and their oldest job's enqueue time, from the ``start``-th tenant
    (the dashboard reads a shard's tenants a chunk per read, so no call runs long).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from worker.store import lua
from worker.store.keys import BREAKER_FIELDS, GROUP, Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

WAITING = lua.script("sched/waiting")
MOST_ENTRIES = 10_000  # stream entries read per shard (running jobs beyond are counted only)
MINUTE_MS = 60_000
PRIORITIES = ("high", "normal", "low")


@dataclass(slots=True)
class Shard:
    """One queue shard now."""

    index: int
    key: str
    length: int = 0  # stream entries: delivered and not acked, and not delivered yet
    pending: int = 0  # delivered, not acked: running (or starting)
    waiting: int = 0  # in the tenants' queues
    tenants: dict[str, int] = field(default_factory=dict)  # waiting per tenant
    upstreams: dict[str, int] = field(default_factory=dict)  # waiting per upstream
    running: dict[str, int] = field(default_factory=dict)  # delivered entries per tenant
    running_upstreams: dict[str, int] = field(default_factory=dict)
    running_routes: dict[str, int] = field(default_factory=dict)  # delivered, per route
    dispatched: dict[str, int] = field(default_factory=dict)  # in the stream, not delivered
    consumers: dict[str, int] = field(default_factory=dict)  # pending entries per consumer
    oldest_undelivered_ms: int | None = None  # entry id time of the oldest not delivered
    config: dict[str, str] = field(default_factory=dict)
    paused: dict[str, float] = field(default_factory=dict)  # upstream -> since (s)

    @property
    def undelivered(self) -> int:
        return max(self.length - self.pending, 0)

    def limits(self) -> dict[str, tuple[int | None, int | None, int | None]]:
        """This shard's share of each limited upstream's (max_concurrent, rpm, tpm)."""
        found = {}
        for name, value in self.config.items():
            if name.startswith("u:"):
                parts = [int(p) if p.isdigit() else None for p in ([*value.split("|"), "", ""])]
                found[name[2:]] = (parts[0], parts[1], parts[2])
        return found

    def served(self) -> list[str]:
        return sorted(name[2:] for name in self.config if name.startswith("s:"))

    def routes(self) -> dict[str, dict[str, Any]]:
        """The routes the workers publish: ``{"s": strategy, "t": [[upstream, model,
        weight], ...], "c": context fallback}`` by name."""
        found = {}
        for name, value in self.config.items():
            if name.startswith("r:") and isinstance(route := _json(value), dict):
                found[name[2:]] = route
        return found

    @property
    def lease_ms(self) -> int:
        value = self.config.get("lease_ms", "")
        return int(value) if value.isdigit() else 30_000


@dataclass(slots=True)
class Fleet:
    """Every shard, the dead letters, the workers, and Redis's clock."""

    now: float
    shards: list[Shard]
    dead: int
    heartbeats: dict[str, float]  # worker -> last heartbeat (Redis time, s)
    reports: dict[str, dict[str, Any]]  # worker -> what it reported with it


@dataclass(slots=True)
class TargetHealth:
    """A route's target as the fleet's breaker holds it (shard 0's copy): ``down_until``
    (ms) while every worker skips it, or its upstream's when that could not be reached."""

    down_until: int | None = None
    since: int | None = None
    why: str = ""
    probing: bool = False
    answered: bool = False  # it answered lately (no trial)
    whole_upstream: bool = False  # its upstream could not be reached

    def skipped(self, now_ms: float) -> bool:
        """Every worker passes it over: its cooldown runs, or a probe is trying it."""
        return self.down_until is not None and (self.down_until > now_ms or self.probing)


@dataclass(slots=True)
class Use:
    """One limited upstream's use on one shard."""

    permits: int = 0
    requests: int = 0  # in the last minute
    tokens: int = 0  # reserved or spent in the last minute
    cooling_ms: int = 0


@dataclass(slots=True)
class Waiting:
    """A tenant's waiting jobs on one shard, by priority."""

    high: int = 0
    normal: int = 0
    low: int = 0
    oldest_ms: int | None = None


class FleetReader:
    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._waiting = redis.register_script(WAITING)

    async def read_shards(self) -> Fleet:
        pipe = self.redis.pipeline(transaction=False)
        for shard, key in enumerate(self.keys.queues):
            sched = self.keys.sched(shard)
            pipe.xlen(key)
            pipe.xinfo_groups(key)
            pipe.xpending(key, GROUP)
            pipe.xrange(key, "-", "+", count=MOST_ENTRIES)
            pipe.hgetall(sched + ":counts")
            pipe.hgetall(sched + ":config")
            pipe.hgetall(sched + ":paused")
        pipe.xlen(self.keys.dead)
        pipe.zrange(self.keys.workers, 0, -1, withscores=True)
        pipe.hgetall(self.keys.workers_info)
        replies = await pipe.execute(raise_on_error=False)
        seconds, micros = await self.redis.time()
        *per_shard, dead, beats, reports = replies
        shards = [
            _shard(index, key, per_shard[index * 7 : index * 7 + 7])
            for index, key in enumerate(self.keys.queues)
        ]
        return Fleet(
            now=seconds + micros / 1e6,
            shards=shards,
            dead=_checked(dead),
            heartbeats={as_text(name): float(score) for name, score in _checked(beats)},
            reports={as_text(k): _json(v) for k, v in (_checked(reports) or {}).items()},
        )

    async def read_use(self, fleet: Fleet) -> dict[tuple[int, str], Use]:
        """The use of every limited upstream on every shard, at ``fleet.now``."""
        now_ms = int(fleet.now * 1000)
        wanted = [(s, name, lim) for s in fleet.shards for name, lim in s.limits().items()]
        pipe = self.redis.pipeline(transaction=False)
        for shard, name, _ in wanted:
            prefix = self.keys.sched(shard.index)
            pipe.zcount(f"{prefix}:permits:{name}", now_ms - shard.lease_ms, "+inf")
            pipe.zcount(f"{prefix}:rpm:{name}", now_ms - MINUTE_MS, "+inf")
            pipe.hget(f"{prefix}:tpmt:{name}", "total")
            pipe.zrangebyscore(f"{prefix}:tpm:{name}", "-inf", now_ms - MINUTE_MS)
            pipe.pttl(f"{prefix}:cool:{name}")
        replies = await pipe.execute()
        found: dict[tuple[int, str], Use] = {}
        expired: list[tuple[Use, str, list[Any]]] = []
        for offset, (shard, name, _) in enumerate(wanted):
            permits, requests, total, old, cool = replies[offset * 5 : offset * 5 + 5]
            use = Use(int(permits), int(requests), int(as_text(total or 0)), max(int(cool), 0))
            found[(shard.index, name)] = use
            if old:
                expired.append((use, f"{self.keys.sched(shard.index)}:tpmt:{name}", old))
        await self._subtract_expired(expired)
        return found

    async def _subtract_expired(self, expired: list[tuple[Use, str, list[Any]]]) -> None:
        """Reservations older than a minute still in the total (the next pick drops them)."""
        if not expired:
            return
        pipe = self.redis.pipeline(transaction=False)
        for _, key, ids in expired:
            pipe.hmget(key, ids)
        for (use, _, _), tokens in zip(expired, await pipe.execute(), strict=True):
            use.tokens = max(use.tokens - sum(int(as_text(t)) for t in tokens if t), 0)

    async def read_targets(self, fleet: Fleet) -> dict[tuple[str, str], TargetHealth]:
        """The breaker's state of every target of the published routes (shard 0)."""
        routes = fleet.shards[0].routes().values() if fleet.shards else ()
        targets = {(str(t[0]), str(t[1])) for route in routes for t in route_targets(route)}
        return await self.read_breakers(sorted(targets))

    async def read_breakers(
        self, targets: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], TargetHealth]:
        """The breaker's state of each (upstream, model), in one round trip (shard 0)."""
        pipe = self.redis.pipeline(transaction=False)
        for upstream, model in targets:
            for key in self.keys.breakers(0, upstream, model):
                pipe.hmget(key, BREAKER_FIELDS)
            pipe.exists(f"{self.keys.sched(0)}:ok:{upstream}|{model}")
        replies = await pipe.execute()
        found = {}
        for offset, target in enumerate(targets):
            whole, own, answered = replies[offset * 3 : offset * 3 + 3]
            found[target] = _health(whole, own, bool(answered))
        return found

    async def targets_down(
        self, targets: Sequence[tuple[str, str, str]]
    ) -> list[tuple[str, str, str, bool]]:
        """Each (route, upstream, model), and whether every worker skips it now."""
        health = await self.read_breakers(sorted({(u, m) for _, u, m in targets}))
        seconds, micros = await self.redis.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        return [(r, u, m, health[(u, m)].skipped(now)) for r, u, m in targets]

    async def read_waiting(self, shard: int, start: int, count: int) -> dict[str, Waiting]:
        """``count`` waiting tenants of ``shard`` from the ``start``-th (in pass order): their
        jobs by priority and their oldest job."""
        keys = [self.keys.queue_shard(shard), self.keys.sched(shard)]
        flat: Any = await self._waiting(keys=keys, args=[start, count])
        found: dict[str, Waiting] = {}
        for at in range(0, len(flat), 5):
            high, normal, low, oldest = (int(v) for v in flat[at + 1 : at + 5])
            found[as_text(flat[at])] = Waiting(high, normal, low, oldest or None)
        return found


def route_targets(route: dict[str, Any]) -> list[list[Any]]:
    """A published route's targets, then its context fallback: ``[upstream, model, weight]``
    each (``worker.store.scheduler.route_text``)."""
    return [*route.get("t", []), *([route["c"]] if route.get("c") else [])]


def _health(whole: list[Any], own: list[Any], answered: bool) -> TargetHealth:
    """A target's health from its upstream's breaker and its own (the upstream's first)."""
    for row, is_upstream in ((whole, True), (own, False)):
        until, since, why, probe = (as_text(v) if v else "" for v in row)
        if until.isdigit():
            return TargetHealth(
                int(until), int(since) if since.isdigit() else None, why, bool(probe), answered,
                is_upstream,
            )  # fmt: skip
    return TargetHealth(answered=answered)


def _shard(index: int, key: str, replies: list[Any]) -> Shard:
    length, groups, summary, entries, counts, config, paused = replies
    shard = Shard(index, key, length=_checked(length))
    delivered = "0-0"
    for group in _missing_stream_ok(groups) or []:
        if as_text(group["name"]) == GROUP:
            delivered = as_text(group["last-delivered-id"])
    summary = _missing_stream_ok(summary) or {}
    shard.pending = int(summary.get("pending") or 0)
    for row in summary.get("consumers") or []:
        shard.consumers[as_text(row["name"])] = int(row["pending"])
    _count_entries(shard, _checked(entries), _id(delivered))
    _count_waiting(shard, _checked(counts))
    shard.config = {as_text(k): as_text(v) for k, v in _checked(config).items()}
    shard.paused = {as_text(k): int(as_text(v)) / 1000 for k, v in _checked(paused).items()}
    return shard


def _count_entries(shard: Shard, entries: list[Any], delivered: tuple[int, int]) -> None:
    for entry_id, fields in entries:
        tenant = as_text(fields.get("tenant", "default"))
        if _id(as_text(entry_id)) > delivered:
            if shard.oldest_undelivered_ms is None:
                shard.oldest_undelivered_ms = _id(as_text(entry_id))[0]
            shard.dispatched[tenant] = shard.dispatched.get(tenant, 0) + 1
            continue
        upstream = as_text(fields.get("upstream", "default"))
        shard.running[tenant] = shard.running.get(tenant, 0) + 1
        shard.running_upstreams[upstream] = shard.running_upstreams.get(upstream, 0) + 1
        if route := as_text(fields.get("route", "")):
            shard.running_routes[route] = shard.running_routes.get(route, 0) + 1


def _count_waiting(shard: Shard, counts: dict[Any, Any]) -> None:
    for name, value in ((as_text(k), int(as_text(v))) for k, v in counts.items()):
        if name == "waiting":
            shard.waiting = max(value, 0)
        elif name.startswith("t:") and value > 0:
            shard.tenants[name[2:]] = value
        elif name.startswith("u:") and value > 0:
            shard.upstreams[name[2:]] = value


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _checked(reply: Any) -> Any:
    if isinstance(reply, Exception):
        raise reply
    return reply


def _missing_stream_ok(reply: Any) -> Any:
    """A shard's stream or group not created yet (no worker started): nothing."""
    if isinstance(reply, ResponseError) and (
        "no such key" in str(reply) or "NOGROUP" in str(reply)
    ):
        return None
    return _checked(reply)


def _json(value: Any) -> dict[str, Any]:
    try:
        found = json.loads(as_text(value))
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}
