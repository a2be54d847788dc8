"""What ``chatstream stats`` reports: queue, pending per consumer, live workers, dead letters
(the command itself in a subprocess: tests/system/test_stats.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from redis.asyncio import Redis

from tests.helpers.harness import busy_queue, chat
from worker.client import Client
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.stats import Stats, collect, render


async def test_stats_of_a_busy_queue(settings: Settings, redis: Redis) -> None:
    keys = await busy_queue(settings, redis)
    await asyncio.sleep(0.05)
    stats = await collect(redis, keys, live_window=30)
    assert stats.queue_length == 3  # the stream holds the jobs taken; the others wait in
    assert (stats.waiting, stats.pending) == (2, 3)  # their tenant's queue
    assert stats.tenants == {"default": {"waiting": 2, "running": 3}}
    assert stats.upstreams == {"default": {"waiting": 2, "permits_in_use": 0}}
    assert stats.pending_by_consumer == {"a": 2, "b": 1}
    assert stats.dead_letters == 2
    assert stats.live_workers == ["w-live-1", "w-live-2"]
    assert stats.stale_workers == ["w-gone"]
    # the oldest waiting job is the 4th enqueued, not the 1st (that one was delivered)
    waiting: Any = await redis.hgetall(keys.sched(0) + ":jobs")
    fourth_ms = min(int(info.rsplit("|", 1)[1]) for info in waiting.values())
    seconds, micros = await redis.time()
    expected = seconds + micros / 1e6 - fourth_ms / 1000
    assert stats.oldest_waiting_seconds is not None
    assert abs(stats.oldest_waiting_seconds - expected) < 0.5
    table = render(stats)
    assert "2 waiting, 3 pending (3 stream entries)" in table
    assert "tenant   default: 2 waiting, 3 running" in table
    assert "2 live, 1 stale" in table
    assert "dead letters  2" in table
    assert json.loads(json.dumps(stats.to_json()))["pending_by_consumer"] == {"a": 2, "b": 1}


async def test_stats_before_any_worker_ran(settings: Settings, redis: Redis) -> None:
    keys = Keys(settings.prefix)
    empty = await collect(redis, keys, live_window=30)
    assert empty == Stats(0, 0, 0, {}, None, 0, [], [], [f"{settings.prefix}:queue"])
    assert "oldest wait   -" in render(empty)
    await Client.from_settings(settings, redis).enqueue(chat("first"))  # no group yet
    queued = await collect(redis, keys, live_window=30)
    assert (queued.queue_length, queued.waiting, queued.pending) == (1, 1, 0)
    assert queued.oldest_waiting_seconds is not None and queued.oldest_waiting_seconds < 5
