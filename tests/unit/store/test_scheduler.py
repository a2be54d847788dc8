"""worker.store.scheduler against a real redis-server: fair shares, priorities, the
upstreams' limits, admission, and what happens to permits when entries are acked, requeued,
taken over or left behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.harness import chat
from worker.client import Client
from worker.errors import InvalidJobError, QueueFullError
from worker.settings import Settings, Upstream
from worker.store.keys import Keys
from worker.store.queue import Entry, Queue
from worker.store.scheduler import Scheduler, Waiting, config_fields, shard_share
from worker.store.stats import queue_counts


async def scheduled(settings: Settings, redis: Redis, **updates: Any) -> Queue:
    """A worker's queue on a fresh prefix, its configuration published with ``updates``."""
    settings = settings.model_copy(update=updates)
    queue = Queue(redis, Keys(settings.prefix, settings.queue_shards), "w1")
    await queue.ensure_group()
    await queue.scheduler.publish(config_fields(settings))
    return queue


def waiting(tenant: str = "default", prompt: int = 10, max_tokens: int | None = None) -> Waiting:
    return Waiting(tenant, "default", prompt, max_tokens)


async def push_all(scheduler: Scheduler, jobs: list[tuple[str, str, str]]) -> None:
    for job_id, tenant, priority in jobs:
        assert await scheduler.push(job_id, waiting(tenant), priority) == "queued"


async def drain(queue: Queue, batch: int = 1) -> list[str]:
    """Every job in the order the scheduler lets them go, acking each as it comes."""
    order: list[str] = []
    while entries := await queue.read(batch, None):
        for entry in entries:
            order.append(entry.job_id or "")
            await queue.ack(entry)
    return order


async def test_a_tenant_alone_gets_everything_first_come_first_served(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis)
    await push_all(queue.scheduler, [(f"a{i}", "a", "normal") for i in range(6)])
    assert await drain(queue, batch=4) == [f"a{i}" for i in range(6)]


async def test_free_capacity_goes_round_robin_among_waiting_tenants(
    settings: Settings, redis: Redis
) -> None:
    """A tenant that arrives behind another's backlog goes next, then they alternate."""
    queue = await scheduled(settings, redis)
    await push_all(queue.scheduler, [(f"a{i}", "batch", "normal") for i in range(20)])
    first = await queue.read(2, None)  # the batch is running
    await push_all(queue.scheduler, [(f"b{i}", "live", "normal") for i in range(3)])
    for entry in first:
        await queue.ack(entry)
    order = await drain(queue)
    assert order[:6] == ["b0", "a2", "b1", "a3", "b2", "a4"], order
    assert order[6:] == [f"a{i}" for i in range(5, 20)]


async def test_weights_shape_the_shares(settings: Settings, redis: Redis) -> None:
    queue = await scheduled(settings, redis, tenant_weights={"live": 3})
    jobs = [(f"b{i}", "batch", "normal") for i in range(40)]
    jobs += [(f"l{i}", "live", "normal") for i in range(40)]
    await push_all(queue.scheduler, jobs)
    first_forty = (await drain(queue))[:40]
    live = sum(job.startswith("l") for job in first_forty)
    assert 29 <= live <= 31, first_forty  # 3 : 1


async def test_within_a_tenant_high_goes_before_normal_before_low(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis)
    jobs = [("first", "t", "low"), ("low1", "t", "low"), ("n1", "t", "normal")]
    jobs += [("low2", "t", "low"), ("h1", "t", "high"), ("n2", "t", "normal"), ("h2", "t", "high")]
    await push_all(queue.scheduler, jobs)  # the first went straight into the stream
    assert await drain(queue) == ["first", "h1", "h2", "n1", "n2", "low1", "low2"]


async def test_an_enqueue_with_nothing_waiting_goes_straight_into_the_stream(
    settings: Settings, redis: Redis
) -> None:
    """A worker blocked reading the stream wakes with it: no pick is needed."""
    queue = await scheduled(settings, redis)
    reader = asyncio.create_task(queue.read(4, 5_000))
    await asyncio.sleep(0.2)  # blocked in XREADGROUP
    began = time.monotonic()
    await queue.scheduler.push("quick", waiting(), "normal")
    [entry] = await asyncio.wait_for(reader, 2)
    assert entry.job_id == "quick" and time.monotonic() - began < 1
    assert (entry.tenant, entry.raw["upstream"], entry.permit) == ("default", "default", "")


# -- limits -----------------------------------------------------------------------------------


async def test_at_most_max_concurrent_leave_the_queue_and_an_ack_lets_the_next_go(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis, upstream_max_concurrent=3)
    await push_all(queue.scheduler, [(f"j{i}", "t", "normal") for i in range(8)])
    running = await queue.read(10, None)
    assert [e.job_id for e in running] == ["j0", "j1", "j2"]
    assert all(entry.permit == "default" for entry in running)
    assert await queue.read(10, None) == []  # no permit: nothing more, nothing polled
    assert (await queue.scheduler.counts()).permits == {"default": 3}
    await queue.ack(running[0])  # frees a permit: the next job is in the stream at once
    assert await redis.xlen(queue.keys.queue) == 3
    [nxt] = await queue.read(10, None)
    assert nxt.job_id == "j3"
    assert (await queue.scheduler.counts()).permits == {"default": 3}


async def test_a_requeue_moves_the_permit_and_a_takeover_keeps_it(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis, upstream_max_concurrent=1)
    await push_all(queue.scheduler, [("j0", "t", "normal"), ("j1", "t", "normal")])
    [entry] = await queue.read(5, None)
    fresh = await queue.requeue(entry, "j0")  # handed back: a fresh entry, the same permit
    assert fresh is not None
    permits = await redis.zrange(queue.keys.sched(0) + ":permits:default", 0, -1)
    assert permits == [fresh]
    other = Queue(redis, queue.keys, "w2")
    [again] = await other.read(5, None)
    assert again.job_id == "j0" and again.permit == "default"
    taken, _ = await queue.take_over("w2", 5)  # w2 died: its entry (and permit) are ours
    assert [t.job_id for t in taken] == ["j0"]
    assert await queue.read(5, None) == []  # still one permit, held by j0
    await queue.ack(taken[0])
    assert [e.job_id for e in await queue.read(5, None)] == ["j1"]


async def test_a_permit_nobody_renews_for_a_lease_is_free_again(
    settings: Settings, redis: Redis
) -> None:
    """Its worker died and nobody took its entry over: after a lease the permit is free;
    one that is renewed stays held."""
    queue = await scheduled(settings, redis, upstream_max_concurrent=1, lease_seconds=0.3)
    await push_all(queue.scheduler, [("j0", "t", "normal"), ("j1", "t", "normal")])
    [held] = await queue.read(5, None)
    for _ in range(3):
        await asyncio.sleep(0.15)
        assert await queue.renew([held]) == []
        assert await queue.read(5, None) == []
    await asyncio.sleep(0.45)  # no renewal for more than a lease
    assert [e.job_id for e in await queue.read(5, None)] == ["j1"]


async def test_requests_per_minute_hold_jobs_back_and_say_for_how_long(
    settings: Settings, redis: Redis
) -> None:
    """A minute's budget of 4 with a burst of the whole minute: 4 go, the rest wait for the
    minute (a blocking read bounded by the wait, not a busy loop)."""
    queue = await scheduled(
        settings, redis, upstream_requests_per_minute=4, requests_burst_seconds=60
    )
    await push_all(queue.scheduler, [(f"j{i}", "t", "normal") for i in range(6)])
    assert len(await queue.read(10, None)) == 4
    began = time.monotonic()
    assert await queue.read(10, 300) == []
    assert 0.25 < time.monotonic() - began < 2
    wait = await queue.scheduler.take_request(0, "default")  # a retry: none left either
    assert 55 < wait <= 60


async def test_requests_per_minute_are_spread_over_the_minute(
    settings: Settings, redis: Redis
) -> None:
    """600 a minute is one every 100 ms; a burst of 0.3 s of that rate lets 3 go at once,
    then one per 100 ms."""
    queue = await scheduled(
        settings, redis, upstream_requests_per_minute=600, requests_burst_seconds=0.3
    )
    await push_all(queue.scheduler, [(f"j{i}", "t", "normal") for i in range(10)])
    assert len(await queue.read(10, None)) == 3
    assert 0 < await queue.scheduler.take_request(0, "default") <= 0.1
    began = time.monotonic()
    got = 0
    while got < 5:
        got += len(await queue.read(10, 1_000))
    assert 0.35 < time.monotonic() - began < 1.0  # 5 more at 100 ms each


async def test_a_retry_takes_one_more_request_of_the_minute(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(
        settings, redis, upstream_requests_per_minute=3, requests_burst_seconds=60
    )
    await push_all(queue.scheduler, [("j0", "t", "normal"), ("j1", "t", "normal")])
    [first] = await queue.read(1, None)
    assert await queue.scheduler.take_request(0, "default") == 0  # its retry: 2 of 3
    assert [e.job_id for e in await queue.read(5, None)] == ["j1"]  # 3 of 3
    assert await queue.scheduler.take_request(0, "default") > 50
    assert first.job_id == "j0"


async def test_tokens_per_minute_admit_on_the_estimate_and_count_the_usage(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(
        settings, redis, upstream_tokens_per_minute=1_000, completion_tokens_estimate=400
    )
    scheduler = queue.scheduler
    await scheduler.push("a", waiting(prompt=100), "normal")  # 100 + 400 assumed
    await scheduler.push("b", waiting(prompt=100, max_tokens=200), "normal")  # 300
    await scheduler.push("c", waiting(prompt=100), "normal")  # 500: over 1,000 for now
    entries = await queue.read(5, None)
    assert [e.job_id for e in entries] == ["a", "b"]
    await scheduler.spend(0, "default", entries[0].entry_id, 150)  # a used 150, not 500
    assert [e.job_id for e in await queue.read(5, None)] == ["c"]  # 150 + 300 + 500


async def test_a_request_larger_than_the_whole_budget_still_goes_alone(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis, upstream_tokens_per_minute=100)
    await queue.scheduler.push("huge", waiting(prompt=5_000), "normal")
    assert [e.job_id for e in await queue.read(5, None)] == ["huge"]


async def test_a_429_pauses_the_upstream_for_every_worker(settings: Settings, redis: Redis) -> None:
    queue = await scheduled(settings, redis, upstream_max_concurrent=10)
    await queue.scheduler.cool_down("default", 0.5)
    await queue.scheduler.push("j0", waiting(), "normal")
    assert await queue.read(5, None) == []
    assert 0 < await queue.scheduler.take_request(0, "default") <= 0.5
    began = time.monotonic()
    assert [e.job_id for e in await queue.read(5, 3_000)] == ["j0"]  # woken by the pause's end
    assert time.monotonic() - began < 1.5


async def test_an_operators_pause_holds_an_upstream_on_every_shard_until_resumed(
    settings: Settings, redis: Redis
) -> None:
    """A paused upstream (even one without limits) gets nothing dispatched, on any shard,
    while the other upstreams' jobs go on; a resume wakes a worker blocked on the stream."""
    fast = Upstream(url="http://127.0.0.1:9/v1")
    queue = await scheduled(settings, redis, upstreams={"fast": fast}, queue_shards=2)
    scheduler = queue.scheduler
    began = time.time()
    assert await scheduler.pause("default") is True
    assert await scheduler.pause("default") is False  # paused already: "since" stays
    since = await scheduler.paused()
    assert list(since) == ["default"] and began - 1 < since["default"] <= time.time() + 1
    jobs = [(f"d{i}", "default") for i in (0, 1, 4, 5)] + [(f"f{i}", "fast") for i in range(2)]
    for job_id, upstream in jobs:
        await scheduler.push(job_id, Waiting("t", upstream, 1, None), "normal")
    assert {queue.keys.shard_of(job_id) for job_id, _ in jobs} == {0, 1}
    taken = [e.job_id for e in await queue.read(10, None)]
    assert sorted(taken, key=str) == ["f0", "f1"]
    assert (await scheduler.counts()).upstreams == {"default": 4}

    reading = asyncio.create_task(queue.read(10, 5_000))
    await asyncio.sleep(0.2)
    began = time.monotonic()
    assert await scheduler.resume("default") is True
    woken = [e.job_id for e in await reading]
    assert woken and time.monotonic() - began < 1.0, woken  # at once, not after the block
    assert await scheduler.paused() == {}
    assert await scheduler.resume("default") is False
    rest = [e.job_id for e in await queue.read(10, None)]
    assert sorted([*woken, *rest], key=str) == ["d0", "d1", "d4", "d5"]


async def test_an_upstream_without_limits_is_not_held_back_by_anothers(
    settings: Settings, redis: Redis
) -> None:
    fast = Upstream(url="http://127.0.0.1:9/v1")
    queue = await scheduled(settings, redis, upstream_max_concurrent=1, upstreams={"fast": fast})
    scheduler = queue.scheduler
    for job_id, upstream in (("s0", "default"), ("s1", "default"), ("f0", "fast")):
        await scheduler.push(job_id, Waiting("t", upstream, 1, None), "normal")
    assert [e.job_id for e in await queue.read(5, None)] == ["s0", "f0"]
    assert not await redis.exists(queue.keys.sched(0) + ":permits:fast")


async def test_limits_are_shared_out_over_the_queue_shards(settings: Settings) -> None:
    assert [shard_share(10, n) for n in (1, 3, 4, 20)] == [10, 4, 3, 1]
    fields = config_fields(settings.model_copy(update={"queue_shards": 4, "max_queued": 10}))
    assert fields["max_queued"] == "3"
    limited = settings.model_copy(update={"upstream_requests_per_minute": 100})
    assert config_fields(limited)["u:default"] == "|100|"


# -- admission and enqueue ------------------------------------------------------------------


async def test_a_full_tenant_queue_refuses_writing_nothing(
    settings: Settings, redis: Redis
) -> None:
    """The bound counts the job a wake-up moved into the stream for a reader (no worker
    read it yet): 2 means 2."""
    await scheduled(settings, redis, max_queued=2)
    client = Client.from_settings(settings, redis)  # the producer sets no bound of its own
    first = await client.enqueue(chat("1"), tenant="acme")  # dispatched: in the stream
    await client.enqueue(chat("2"), tenant="acme")
    with pytest.raises(QueueFullError, match="tenant 'acme' has 2 jobs waiting") as refused:
        await client.enqueue(chat("3"), job_id="refused", tenant="acme")
    assert (refused.value.tenant, refused.value.waiting) == ("acme", 2)
    assert not await redis.exists(client.keys.job("refused"))
    assert await redis.zscore(client.keys.jobs, "refused") is None
    assert await client.enqueue(chat("other tenant"), tenant="other")  # its own bound
    assert (await client.get(first)).tenant == "acme"


async def test_a_job_read_by_a_worker_no_longer_counts_against_the_bound(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis, max_queued=2)
    client = Client.from_settings(settings, redis)
    await client.enqueue(chat("1"), tenant="acme")
    await client.enqueue(chat("2"), tenant="acme")
    assert len(await queue.read(1, None)) == 1  # the one in the stream runs now
    await client.enqueue(chat("3"), tenant="acme")
    with pytest.raises(QueueFullError):
        await client.enqueue(chat("4"), tenant="acme")


async def test_the_stricter_of_the_producers_and_the_workers_bound_applies(
    settings: Settings, redis: Redis
) -> None:
    await scheduled(settings, redis, max_queued=10)
    strict = Client.from_settings(settings.model_copy(update={"max_queued": 2}), redis)
    await strict.enqueue(chat("dispatched"))
    await strict.enqueue(chat("waits"))
    with pytest.raises(QueueFullError):
        await strict.enqueue(chat("refused"))


async def test_a_cancelled_waiting_job_leaves_its_tenants_queue(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis)
    client = Client.from_settings(settings, redis)
    runs = await client.enqueue(chat("runs"))
    job_id = await client.enqueue(chat("waits"), tenant="t")
    assert (await queue_counts(redis, client.keys)).scheduled == 1
    assert await client.cancel(job_id) == "cancelled"
    assert (await queue_counts(redis, client.keys)).scheduled == 0
    assert (await queue.scheduler.counts()).tenants == {}
    assert [e.job_id for e in await queue.read(5, None)] == [runs]


async def test_enqueue_records_tenant_and_priority(settings: Settings, redis: Redis) -> None:
    client = Client.from_settings(settings, redis)
    job_id = await client.enqueue(chat(), tenant="acme", priority="high")
    record = await client.get(job_id)
    assert (record.tenant, record.priority) == ("acme", "high")
    for tenant in ("no spaces", "x" * 65):
        with pytest.raises(InvalidJobError, match="tenant"):
            await client.enqueue(chat(), tenant=tenant)
    with pytest.raises(InvalidJobError, match="priority"):
        await client.enqueue(chat(), priority="urgent")  # type: ignore[arg-type]


async def test_enqueue_many_queues_every_job_in_order(settings: Settings, redis: Redis) -> None:
    queue = await scheduled(settings, redis)
    client = Client.from_settings(settings, redis)
    ids = await client.enqueue_many([chat(f"n{i}") for i in range(2_500)], tenant="bulk")
    assert len(set(ids)) == 2_500
    counts = await queue_counts(redis, client.keys)
    assert counts.length + counts.scheduled == 2_500
    records = [await client.get(job_id) for job_id in (ids[0], ids[1_234], ids[-1])]
    assert {(r.status, r.tenant, r.queue_entry) for r in records} == {("queued", "bulk", "tenant")}
    assert [e.job_id for e in await queue.read(3, None)] == ids[:3]  # first come, first served
    page = await client.jobs(limit=3)
    assert len(page.jobs) == 3 and {job.id for job in page.jobs} <= set(ids)


async def snapshot(redis: Redis, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` and what it holds, without the times that differ."""
    state: dict[str, Any] = {}
    async for key in redis.scan_iter(match=f"{prefix}:*"):
        kind = await redis.type(key)
        if kind == "hash":
            value: Any = await redis.hgetall(key)
            if key.endswith(":jobs"):  # 'tenant|upstream|tokens|max|enqueued ms'
                value = {k: v.rsplit("|", 1)[0] for k, v in value.items()}
        elif kind == "zset":
            value = await redis.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            value = await redis.smembers(key)
        elif kind == "stream":
            entries: Any = await redis.xrange(key)
            value = [fields for _, fields in entries]
        else:
            value = await redis.get(key)
        state[key.replace(prefix, "")] = value  # (the prefix is in hash tags too)
    return state


@pytest.mark.parametrize("before", ["nothing", "an entry in the stream", "a cooling upstream"])
async def test_a_push_of_many_jobs_leaves_what_one_push_each_leaves(
    settings: Settings, redis: Redis, before: str
) -> None:
    """enqueue_many pushes up to PUSH_CHUNK jobs per call: the replies and what Redis holds
    are those of one call per job, refusals at the tenant's bound included; whether the
    first job is dispatched, an entry waits in the stream already, or nothing may be
    dispatched (every job's push tries again)."""
    priorities = ("high", "normal", "low")
    jobs = [(f"j{i}", waiting("abc"[i % 3]), priorities[i % 2 + i % 3 // 2]) for i in range(40)]
    results: dict[str, Any] = {}
    for mode in ("one", "many"):
        prefix = f"{settings.prefix}-{mode}"
        queue = await scheduled(settings, redis, prefix=prefix, max_queued=10)
        scheduler, keys = queue.scheduler, queue.scheduler.shard_keys(0)
        if before == "an entry in the stream":
            await redis.xadd(queue.keys.queue, {"job": "earlier"})
        elif before == "a cooling upstream":
            await scheduler.cool_down("default", 30)
        if mode == "one":
            replies = [
                (await scheduler.push_script(keys=keys, args=scheduler.push_args([job], None)))[0]
                for job in jobs
            ]
        else:
            replies = await scheduler.push_script(keys=keys, args=scheduler.push_args(jobs, None))
        results[mode] = (replies, await snapshot(redis, prefix))
    replies, _ = results["many"]
    assert [reply[0] for reply in replies].count("full") > 0  # the bound was reached
    assert results["many"] == results["one"]


async def test_enqueue_many_on_shards_says_which_jobs_it_queued(
    settings: Settings, redis: Redis
) -> None:
    """Two shards, a tenant past its bound, several push calls per shard in one round: the
    jobs said to be queued are exactly those in the scheduler, the others left nothing."""
    sharded = settings.model_copy(update={"queue_shards": 2})
    await scheduled(sharded, redis, max_queued=60)
    client = Client.from_settings(sharded, redis)
    with pytest.raises(QueueFullError) as refused:
        await client.enqueue_many([chat(f"n{i}") for i in range(225)], batch=300)
    queued = set(refused.value.queued)
    in_scheduler: set[str] = set()
    for shard, stream in enumerate(client.keys.queues):
        waiting_ids: Any = await redis.hkeys(client.keys.sched(shard) + ":jobs")
        entries: Any = await redis.xrange(stream)
        in_scheduler.update(waiting_ids, (fields["job"] for _, fields in entries))
    assert queued == in_scheduler and 60 <= len(queued) < 225
    records = [key async for key in redis.scan_iter(match=f"{sharded.prefix}:job:*")]
    assert {key.rsplit(":", 1)[1].strip("{}") for key in records} == queued
    assert {(await client.get(job_id)).status for job_id in queued} == {"queued"}


async def test_enqueue_many_validates_everything_first(settings: Settings, redis: Redis) -> None:
    client = Client.from_settings(settings, redis)
    with pytest.raises(InvalidJobError, match=r"requests\[1\]: invalid job: request.messages"):
        await client.enqueue_many([chat("fine"), {"model": "m", "messages": []}])
    assert (await queue_counts(redis, client.keys)).length == 0


async def test_enqueue_many_stops_at_a_full_queue_and_says_what_it_queued(
    settings: Settings, redis: Redis
) -> None:
    await scheduled(settings, redis, max_queued=5)
    client = Client.from_settings(settings, redis)
    with pytest.raises(QueueFullError) as refused:
        await client.enqueue_many([chat(f"n{i}") for i in range(20)], batch=8)
    queued = refused.value.queued
    assert len(queued) == 5  # one dispatched into the stream, four waiting
    counts = await queue_counts(redis, client.keys)
    assert counts.length + counts.scheduled == 5
    assert [(await client.get(job_id)).status for job_id in queued] == ["queued"] * 5
    assert len(await redis.zrange(client.keys.jobs, 0, -1)) == 5  # the refused: unlisted


async def test_entry_of_a_producers_own_xadd_has_no_permit(
    settings: Settings, redis: Redis
) -> None:
    queue = await scheduled(settings, redis, upstream_max_concurrent=1)
    await redis.xadd(queue.keys.queue, {"job": "raw"})
    [entry] = await queue.read(5, None)
    assert isinstance(entry, Entry) and entry.job_id == "raw"
    assert (entry.permit, entry.tenant, entry.dispatched_at) == ("", "default", None)
