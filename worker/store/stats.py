"""``chatstream stats``: the queue and the fleet at a glance, read from Redis.

Queue length (XLEN: entries waiting plus entries delivered and not yet acked), pending
entries per consumer (XPENDING summary), jobs waiting in their tenants' queues (the
scheduler's counts), all summed over the queue's shards; per tenant the jobs waiting and
running, per upstream the jobs waiting and the permits in use; live workers (heartbeats in
the workers zset newer than the lease: three missed heartbeats), dead letters, and the age
of the oldest job still waiting (in a stream or a tenant's queue, on any shard). Ages are
measured against the Redis server's clock (stream ids are Redis time; heartbeats are the
workers' wall clocks).

``waiting`` is the number to scale workers on: jobs that wait for a worker or for their
upstream's limits (docs/scaling.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from worker.store.keys import GROUP, Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient
from worker.store.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """What the metrics refresh reads every maintenance tick (one round trip)."""

    length: int  # stream entries: undelivered plus delivered and not acked
    pending: int  # delivered and not acked: running (or about to)
    dead: int
    scheduled: int = 0  # waiting in the tenants' queues

    @property
    def waiting(self) -> int:
        """Jobs waiting to run: undelivered stream entries and the tenants' queues."""
        return max(self.length - self.pending, 0) + self.scheduled


@dataclass(frozen=True, slots=True)
class Stats:
    queue_length: int
    waiting: int
    pending: int
    pending_by_consumer: dict[str, int]
    oldest_waiting_seconds: float | None
    dead_letters: int
    live_workers: list[str] = field(default_factory=list)
    stale_workers: list[str] = field(default_factory=list)
    queue_keys: list[str] = field(default_factory=list)  # the shards, in order
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)  # waiting, running
    upstreams: dict[str, dict[str, int]] = field(default_factory=dict)  # waiting, permits

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def queue_counts(redis: RedisClient, keys: Keys) -> QueueCounts:
    """Queue length and pending entries summed over the shards, and dead letters."""
    pipe = redis.pipeline(transaction=False)
    for shard, key in enumerate(keys.queues):
        pipe.xlen(key)
        pipe.xpending(key, GROUP)
        pipe.hget(keys.sched(shard) + ":counts", "waiting")
    pipe.xlen(keys.dead)
    *per_shard, dead = await pipe.execute(raise_on_error=False)
    for result in (*per_shard[0::3], *per_shard[2::3], dead):
        if isinstance(result, Exception):
            raise result
    pending = sum(_pending_total(summary) for summary in per_shard[1::3])
    length = sum(int(length) for length in per_shard[0::3])
    scheduled = sum(max(int(as_text(n)), 0) for n in per_shard[2::3] if n is not None)
    return QueueCounts(length, pending, int(dead), scheduled)


def _pending_total(summary: Any) -> int:
    if isinstance(summary, ResponseError) and "NOGROUP" in str(summary):
        return 0  # no worker has created the group yet
    if isinstance(summary, Exception):
        raise summary
    return int(summary["pending"])


async def collect(redis: RedisClient, keys: Keys, live_window: float) -> Stats:
    """A snapshot; ``live_window``: heartbeats older than this many seconds are stale."""
    counts = await queue_counts(redis, keys)
    seconds, micros = await redis.time()
    now = seconds + micros / 1e6
    by_consumer = await _pending_by_consumer(redis, keys) if counts.pending else {}
    oldest = min(
        (t for t in (await _oldest_waiting(redis, keys), await oldest_scheduled(redis, keys)) if t),
        default=None,
    )
    beats: Any = await redis.zrange(keys.workers, 0, -1, withscores=True)
    live = [as_text(name) for name, beat in beats if now - beat <= live_window]
    stale = [as_text(name) for name, beat in beats if now - beat > live_window]
    scheduled = await Scheduler(redis, keys).counts()
    running = await running_by_tenant(redis, keys) if counts.pending else {}
    return Stats(
        queue_length=counts.length,
        waiting=counts.waiting,
        pending=counts.pending,
        pending_by_consumer=by_consumer,
        oldest_waiting_seconds=None if oldest is None else max(now - oldest, 0.0),
        dead_letters=counts.dead,
        live_workers=sorted(live),
        stale_workers=sorted(stale),
        queue_keys=list(keys.queues),
        tenants={
            name: {"waiting": scheduled.tenants.get(name, 0), "running": running.get(name, 0)}
            for name in sorted({*scheduled.tenants, *running})
        },
        upstreams={
            name: {
                "waiting": scheduled.upstreams.get(name, 0),
                "permits_in_use": scheduled.permits.get(name, 0),
            }
            for name in sorted({*scheduled.upstreams, *scheduled.permits})
        },
    )


async def running_by_tenant(redis: RedisClient, keys: Keys, most: int = 10_000) -> dict[str, int]:
    """Delivered entries per tenant (their ``tenant`` field; ``default`` without one)."""
    counts: dict[str, int] = {}
    for key in keys.queues:
        rows = await redis.xpending_range(key, GROUP, min="-", max="+", count=most)
        pipe = redis.pipeline(transaction=False)
        for row in rows:
            pipe.xrange(key, row["message_id"], row["message_id"])
        for found in await pipe.execute():
            fields = {as_text(k): as_text(v) for k, v in found[0][1].items()} if found else {}
            tenant = fields.get("tenant", "default")
            counts[tenant] = counts.get(tenant, 0) + 1
    return counts


async def oldest_scheduled(redis: RedisClient, keys: Keys) -> float | None:
    """When the oldest job still waiting in a tenant's queue was enqueued (Redis time, s):
    the head of each priority of each queue (each is first come, first served)."""
    oldest: float | None = None
    for shard in range(keys.shards):
        prefix = keys.sched(shard)
        for tenant in await redis.zrange(prefix + ":tenants", 0, -1):
            for upstream in await redis.smembers(f"{prefix}:tu:{as_text(tenant)}"):
                queue = f"{prefix}:q:{as_text(tenant)}:{as_text(upstream)}"
                for rank in range(3):
                    low, high = rank * 1e13, (rank + 1) * 1e13
                    head = await redis.zrangebyscore(queue, low, f"({high}", start=0, num=1)
                    info = await redis.hget(prefix + ":jobs", as_text(head[0])) if head else None
                    when = int(as_text(info).rsplit("|", 1)[1]) / 1000 if info else None
                    if when is not None and (oldest is None or when < oldest):
                        oldest = when
    return oldest


async def _pending_by_consumer(redis: RedisClient, keys: Keys) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in keys.queues:
        summary = await redis.xpending(key, GROUP)
        for row in summary.get("consumers") or []:
            name = as_text(row["name"])
            counts[name] = counts.get(name, 0) + int(row["pending"])
    return counts


async def _oldest_waiting(redis: RedisClient, keys: Keys) -> float | None:
    """Redis time (seconds) of the oldest entry not yet delivered to the group, any shard."""
    oldest = [when for key in keys.queues if (when := await _oldest_in(redis, key)) is not None]
    return min(oldest, default=None)


async def _oldest_in(redis: RedisClient, key: str) -> float | None:
    start = "-"
    try:
        groups = await redis.xinfo_groups(key)
    except ResponseError:  # no queue stream yet
        return None
    for group in groups:
        if as_text(group["name"]) == GROUP:
            start = "(" + as_text(group["last-delivered-id"])
    rows: Any = await redis.xrange(key, min=start, max="+", count=1)
    if not rows:
        return None
    return int(as_text(rows[0][0]).split("-")[0]) / 1000


def render(stats: Stats) -> str:
    """The compact human table."""
    oldest = stats.oldest_waiting_seconds
    lines = [
        f"queue         {stats.waiting} waiting, {stats.pending} pending "
        f"({stats.queue_length} stream entries)",
        f"oldest wait   {'-' if oldest is None else f'{oldest:.1f}s'}",
        f"workers       {len(stats.live_workers)} live, {len(stats.stale_workers)} stale",
        f"dead letters  {stats.dead_letters}",
    ]
    if len(stats.queue_keys) > 1:
        lines.insert(1, f"shards        {len(stats.queue_keys)} queue streams")
    for name, tenant in stats.tenants.items():
        lines.append(f"  tenant   {name}: {tenant['waiting']} waiting, {tenant['running']} running")
    for name, upstream in stats.upstreams.items():
        lines.append(
            f"  upstream {name}: {upstream['waiting']} waiting, "
            f"{upstream['permits_in_use']} permits in use"
        )
    for name, count in sorted(stats.pending_by_consumer.items()):
        lines.append(f"  pending  {count:>6}  {name}")
    for name in stats.live_workers:
        lines.append(f"  live     {name}")
    return "\n".join(lines)
