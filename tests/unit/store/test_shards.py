"""The queue split over several streams (CHATSTREAM_QUEUE_SHARDS) on one real redis-server:
enqueue spreads jobs, a worker reads every shard fairly and at once, and the rest of the
queue's life (takeover, hand-back, dead letters, stats, the jobs index) works per shard.
Test_cluster.py runs the same on a real Redis Cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tests.helpers.checks import check_stream, eventually, queue_is_drained, stream_entries
from tests.helpers.harness import Harness, chat, custom_harness, spread
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.store.keys import GROUP, Keys
from worker.store.queue import Queue
from worker.store.redis_client import RedisClient
from worker.store.stats import collect

SHARDS = 3


@pytest.fixture
async def sharded(harness: Harness) -> AsyncIterator[Harness]:
    await harness.worker.shutdown()  # the default one-shard worker steps aside
    async with custom_harness(harness, queue_shards=SHARDS) as h:
        yield h


async def shard_lengths(redis: RedisClient, keys: Keys) -> list[int]:
    """Jobs on each shard: in its stream and waiting in its tenants' queues."""
    lengths = []
    for shard, key in enumerate(keys.queues):
        waiting = await redis.hget(keys.sched(shard) + ":counts", "waiting")
        lengths.append(int(await redis.xlen(key)) + int(waiting or 0))
    return lengths


async def test_jobs_spread_over_the_shards_and_all_run(sharded: Harness) -> None:
    keys = sharded.worker.keys
    ids = [await sharded.client.enqueue(chat(f"job {i}", tokens=3)) for i in range(30)]
    lengths = await shard_lengths(sharded.redis, keys)
    assert sum(lengths) == 30 and min(lengths) >= 1, lengths  # (>= 4 failed 1 run in 100)
    assert await sharded.worker.run_burst() == 30
    for job_id in ids:
        record = await sharded.client.get(job_id)
        assert record.status == "succeeded"
        check_stream(await stream_entries(sharded.redis, keys, job_id), record)
    assert await queue_is_drained(sharded.redis, keys)
    page = await sharded.client.jobs(limit=100)
    assert sorted(job.id for job in page.jobs) == sorted(ids)  # the shards' indexes merged
    created = [job.created_at or 0.0 for job in page.jobs]
    assert created == sorted(created, reverse=True)


async def test_a_read_takes_from_every_shard_in_turn(sharded: Harness) -> None:
    """With entries waiting on every shard, reads of one entry each rotate over them."""
    keys = sharded.worker.keys
    queue = Queue(sharded.redis, keys, "reader")
    await queue.ensure_group()
    for shard, key in enumerate(keys.queues):
        for n in range(3):
            await sharded.redis.xadd(key, {"job": f"s{shard}-{n}"})
    shards = [entry.shard for _ in range(6) for entry in await queue.read(1, None)]
    assert sorted(shards[:3]) == [0, 1, 2] and sorted(shards[3:]) == [0, 1, 2]
    await queue.close()


async def test_a_waiting_worker_starts_a_job_on_any_shard_at_once(sharded: Harness) -> None:
    """No shard waits for another's blocking read to time out (block_ms is 2 s here)."""
    settings = sharded.settings.model_copy(update={"block_ms": 2_000})
    async with custom_harness(sharded, block_ms=2_000) as h:
        consume = asyncio.create_task(h.worker.consume())
        await asyncio.sleep(0.3)  # every shard's blocking read is waiting
        try:
            for n in range(6):
                job_id = f"wake-{n}"
                began = time.monotonic()
                await h.client.enqueue(chat("quick", tokens=1), job_id=job_id)
                record = await h.client.result(job_id, timeout=5)
                assert record.status == "succeeded"
                assert time.monotonic() - began < 1.0, (job_id, settings.block_ms)
            shards = {h.worker.keys.shard_of(f"wake-{n}") for n in range(6)}
            assert len(shards) > 1  # the test did touch several shards
        finally:
            h.worker.stopping.set()
            await cancel_and_wait([consume])


async def test_a_dead_workers_entries_on_every_shard_are_taken_over(sharded: Harness) -> None:
    keys = sharded.worker.keys
    dead = Queue(sharded.redis, keys, "dead-worker")
    ids = [await sharded.client.enqueue(chat("orphan", tokens=2), job_id=i) for i in spread(keys)]
    delivered = [entry for _ in range(3) for entry in await dead.read(9, None)]
    assert {entry.shard for entry in delivered} == {0, 1, 2} and len(delivered) == 9
    taken, emptied = await sharded.worker.queue.take_over("dead-worker", 100)
    assert emptied and sorted(e.job_id or "" for e in taken) == sorted(ids)
    for entry in taken:
        sharded.worker.launch(entry)
    await eventually(lambda: queue_is_drained(sharded.redis, keys))
    assert {(await sharded.client.get(job_id)).status for job_id in ids} == {"succeeded"}


async def test_stats_and_hand_back_count_every_shard(sharded: Harness) -> None:
    keys = sharded.worker.keys
    ids = [await sharded.client.enqueue(chat(f"wait {i}")) for i in range(7)]
    held = Queue(sharded.redis, keys, "holder")
    mine = [entry for _ in range(3) for entry in await held.read(2, None)]
    stats = await collect(sharded.redis, keys, live_window=30)
    assert stats.pending == len(mine) and stats.queue_length >= len(mine)
    assert stats.pending_by_consumer == {"holder": len(mine)}
    assert stats.waiting == 7 - len(mine)
    assert stats.queue_keys == list(keys.queues) and len(stats.queue_keys) == SHARDS
    for entry in mine:  # what a stopping worker does with entries it never started
        assert entry.job_id in ids
        assert await held.requeue(entry, entry.job_id or "") is not None
    for key in keys.queues:
        summary = await sharded.redis.xpending(key, GROUP)
        assert summary["pending"] == 0
    assert sum(await shard_lengths(sharded.redis, keys)) == 7


async def test_dead_letters_are_requeued_on_the_jobs_shard(sharded: Harness) -> None:
    keys = sharded.worker.keys
    client = Client.from_settings(sharded.settings, sharded.redis)
    job_id = await client.enqueue(chat("doomed", fault="http_400"))
    await sharded.worker.run_burst()
    assert (await client.get(job_id)).status == "failed"
    assert await client.requeue(job_id) == "requeued"
    lengths = await shard_lengths(sharded.redis, keys)
    assert lengths[keys.shard_of(job_id)] == 1 and sum(lengths) == 1


async def test_blocking_reads_reserve_no_more_than_the_free_slots(sharded: Harness) -> None:
    """What reads still waiting may deliver counts against the next call's free slots, so a
    worker never holds more than one entry per shard beyond its free slots."""
    keys = sharded.worker.keys
    queue = Queue(sharded.redis, keys, "reserving")
    await queue.ensure_group()

    async def add(shard: int, n: int) -> None:
        """n entries at once (MULTI: a blocked read sees them all, not the first alone)."""
        pipe = sharded.redis.pipeline(transaction=True)
        for i in range(n):
            pipe.xadd(keys.queue_shard(shard), {"job": f"s{shard}-{i}"})
        await pipe.execute()

    first = asyncio.create_task(queue.read(30, 2_000))  # all empty: 3 reads of 10 each
    await asyncio.sleep(0.2)
    await add(0, 1)
    assert len(await first) == 1  # 29 slots free now; shards 1 and 2 still hold 10 each
    assert {shard: share for shard, (_, share) in queue._waiting.items()} == {1: 10, 2: 10}
    await add(0, 9)
    assert len(await queue.read(29, 2_000)) == 9  # 29 - 20 reserved
    third = asyncio.create_task(queue.read(20, 2_000))  # nothing left: shard 0 gets 1 more
    await asyncio.sleep(0.2)
    shares = {shard: share for shard, (_, share) in queue._waiting.items()}
    assert shares == {0: 1, 1: 10, 2: 10}
    await add(1, 12)
    assert len(await third) == 10
    await queue.close()
