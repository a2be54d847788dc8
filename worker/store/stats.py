"""``chatstream stats``: the queue and the fleet at a glance, read from Redis.

Queue length (XLEN: entries waiting plus entries delivered and not yet acked), pending
entries per consumer (XPENDING summary), both summed over the queue's shards, live workers
(heartbeats in the workers zset newer than the lease: three missed heartbeats), dead
letters, and the age of the oldest job still waiting for delivery (on any shard). Ages are
measured against the Redis server's clock (stream ids are Redis time; heartbeats are the
workers' wall clocks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from worker.store.keys import GROUP, Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient


@dataclass(frozen=True, slots=True)
class QueueCounts:
    """What the metrics refresh reads every maintenance tick (one round trip)."""

    length: int
    pending: int
    dead: int


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def queue_counts(redis: RedisClient, keys: Keys) -> QueueCounts:
    """Queue length and pending entries summed over the shards, and dead letters."""
    pipe = redis.pipeline(transaction=False)
    for key in keys.queues:
        pipe.xlen(key)
        pipe.xpending(key, GROUP)
    pipe.xlen(keys.dead)
    *per_shard, dead = await pipe.execute(raise_on_error=False)
    for result in (*per_shard[0::2], dead):
        if isinstance(result, Exception):
            raise result
    pending = sum(_pending_total(summary) for summary in per_shard[1::2])
    return QueueCounts(sum(int(length) for length in per_shard[0::2]), pending, int(dead))


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
    oldest = await _oldest_waiting(redis, keys)
    beats: Any = await redis.zrange(keys.workers, 0, -1, withscores=True)
    live = [as_text(name) for name, beat in beats if now - beat <= live_window]
    stale = [as_text(name) for name, beat in beats if now - beat > live_window]
    return Stats(
        queue_length=counts.length,
        waiting=max(counts.length - counts.pending, 0),
        pending=counts.pending,
        pending_by_consumer=by_consumer,
        oldest_waiting_seconds=None if oldest is None else max(now - oldest, 0.0),
        dead_letters=counts.dead,
        live_workers=sorted(live),
        stale_workers=sorted(stale),
        queue_keys=list(keys.queues),
    )


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
        f"queue         {stats.queue_length} entries: "
        f"{stats.waiting} waiting, {stats.pending} pending",
        f"oldest wait   {'-' if oldest is None else f'{oldest:.1f}s'}",
        f"workers       {len(stats.live_workers)} live, {len(stats.stale_workers)} stale",
        f"dead letters  {stats.dead_letters}",
    ]
    if len(stats.queue_keys) > 1:
        lines.insert(1, f"shards        {len(stats.queue_keys)} queue streams")
    for name, count in sorted(stats.pending_by_consumer.items()):
        lines.append(f"  pending  {count:>6}  {name}")
    for name in stats.live_workers:
        lines.append(f"  live     {name}")
    return "\n".join(lines)
