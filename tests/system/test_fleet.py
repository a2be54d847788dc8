"""Fleet controls on real worker processes: an upstream's limits shared by every worker (a
mock upstream that enforces a provider's caps with 429s), a killed worker's permits, tenants'
fair shares, weights and priorities (docs/scaling.md, docs/reliability.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import signal
import time

import pytest

from tests.helpers.checks import eventually, statuses
from tests.helpers.fleet import Fleet
from tests.helpers.harness import chat
from worker.client import Client
from worker.errors import QueueFullError
from worker.store.scheduler import Scheduler
from worker.store.stats import queue_counts

pytestmark = pytest.mark.xdist_group("worker-processes")

JOB = {"tokens": 20, "rate": 40.0}  # about half a second upstream


def provider_caps(fleet: Fleet, max_concurrent: int = 0, requests_per_minute: int = 0) -> None:
    """The mock answers 429 beyond these (a provider's limits on one API key)."""
    fleet.mock.config = dataclasses.replace(
        fleet.mock.config, max_concurrent=max_concurrent, requests_per_minute=requests_per_minute
    )


async def all_succeed(fleet: Fleet, ids: list[str], timeout: float) -> float:
    """Seconds until every job ended; each must have succeeded."""
    began = time.monotonic()

    async def ended() -> bool:
        found = await statuses(fleet.redis, fleet.keys, ids)
        return all(status in ("succeeded", "failed", "cancelled") for status in found)

    await eventually(ended, timeout, every=0.1)
    elapsed = time.monotonic() - began
    assert await statuses(fleet.redis, fleet.keys, ids) == ["succeeded"] * len(ids)
    return elapsed


async def dispatch_wait(fleet: Fleet, job_id: str) -> float:
    record = await fleet.client.get(job_id)
    assert record.dispatched_at is not None and record.created_at is not None
    return record.dispatched_at - record.created_at


async def test_three_workers_never_exceed_the_providers_caps_and_drain_near_the_ideal(
    fleet: Fleet,
) -> None:
    """3 workers x 16 slots against a provider allowing 6 streams at once: with the fleet's
    limit set to 6 the provider sees no 429 and the backlog drains within 30% of the time 6
    streams at once need."""
    provider_caps(fleet, max_concurrent=6, requests_per_minute=600)
    await fleet.start(3, concurrency=16, upstream_max_concurrent=6)
    one = time.monotonic()
    await fleet.client.result(await fleet.client.enqueue(chat("warm", **JOB)), timeout=10)
    job_seconds = time.monotonic() - one
    ids = await fleet.client.enqueue_many([chat(f"j{i}", **JOB) for i in range(60)])
    elapsed = await all_succeed(fleet, ids, 60)
    ideal = 60 / 6 * job_seconds
    assert fleet.mock.rate_limited == 0
    assert fleet.mock.most_concurrent == 6
    assert elapsed <= 1.3 * ideal, (elapsed, ideal)
    assert (await Scheduler(fleet.redis, fleet.keys).counts()).permits == {"default": 0}
    await fleet.stop()


async def test_without_the_fleets_limit_the_same_provider_answers_429s(fleet: Fleet) -> None:
    """The control of the test above: each worker on its own sends what it has slots for."""
    provider_caps(fleet, max_concurrent=6)
    await fleet.start(3, concurrency=16)
    ids = await fleet.client.enqueue_many([chat(f"j{i}", **JOB) for i in range(30)])
    await all_succeed(fleet, ids, 60)
    assert fleet.mock.rate_limited > 0
    await fleet.stop()


async def test_requests_per_minute_hold_the_rest_back_without_a_429(fleet: Fleet) -> None:
    """A burst of the whole minute (CHATSTREAM_REQUESTS_BURST_SECONDS=60): the minute's 8
    go at once, the rest wait in their tenant's queue for the minute."""
    provider_caps(fleet, requests_per_minute=8)
    await fleet.start(2, upstream_requests_per_minute=8, requests_burst_seconds=60)
    ids = await fleet.client.enqueue_many([chat(f"j{i}", tokens=2) for i in range(12)])
    await all_succeed(fleet, ids[:8], 20)
    await asyncio.sleep(2)  # the rest wait for the minute, in their tenant's queue
    assert fleet.mock.requests["/v1/chat/completions"] == 8
    assert fleet.mock.rate_limited == 0
    assert await statuses(fleet.redis, fleet.keys, ids[8:]) == ["queued"] * 4
    for job_id in ids[8:]:  # a waiting job cancels at once
        assert await fleet.client.cancel(job_id) == "cancelled"
    assert (await Scheduler(fleet.redis, fleet.keys).counts()).waiting == 0
    await fleet.stop()


async def test_a_provider_lower_than_configured_slows_the_fleet_as_one(fleet: Fleet) -> None:
    """The provider allows 3 at once, the fleet was told 8: each 429 pauses the upstream for
    every worker (Retry-After 1 s): the 429s come in bursts (the requests already on their
    way), a pause apart, and every job still succeeds."""
    provider_caps(fleet, max_concurrent=3)
    await fleet.start(3, concurrency=16, upstream_max_concurrent=8, retry_max_backoff=2)
    ids = await fleet.client.enqueue_many([chat(f"j{i}", **JOB) for i in range(24)])
    await all_succeed(fleet, ids, 90)
    times = fleet.mock.rate_limited_at
    assert times
    bursts = [t for prev, t in zip([-10.0, *times], times, strict=False) if t - prev > 0.3]
    gaps = [later - earlier for earlier, later in itertools.pairwise(bursts)]
    assert all(gap >= 0.8 for gap in gaps), gaps  # nobody sent anything during a pause
    logs = await fleet.stop()
    assert "every worker pauses it" in logs


async def test_a_killed_workers_permits_come_back_within_the_heartbeat_timeout(
    fleet: Fleet,
) -> None:
    provider_caps(fleet, max_concurrent=4)
    slow = {"tokens": 40, "rate": 20.0}  # 2 s each
    workers = await fleet.start(3, upstream_max_concurrent=4)
    ids = await fleet.client.enqueue_many([chat(f"j{i}", **slow) for i in range(16)])
    await eventually(lambda: _in_progress(fleet, 4), 15)
    victim = workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    await asyncio.sleep(0.5)  # its streams were cut: fewer than 4 in progress, if it held any
    await eventually(lambda: _in_progress(fleet, 4), 10)
    assert time.monotonic() - killed_at < 3 + 3  # the heartbeat timeout (3 s), and a margin
    await all_succeed(fleet, ids, 90)
    assert fleet.mock.rate_limited == 0 and fleet.mock.most_concurrent <= 4
    assert (await Scheduler(fleet.redis, fleet.keys).counts()).permits == {"default": 0}
    await fleet.stop(workers[1:])


async def _in_progress(fleet: Fleet, count: int) -> bool:
    return fleet.mock.in_progress == count


# -- tenants ----------------------------------------------------------------------------------


async def test_a_tenants_first_job_starts_at_once_behind_anothers_backlog(fleet: Fleet) -> None:
    await fleet.start(2, concurrency=10)  # 20 streams of capacity
    backlog = await fleet.client.enqueue_many(
        [chat(f"b{i}", tokens=20, rate=20.0) for i in range(300)], tenant="batch"
    )
    await asyncio.sleep(1.5)
    live = await fleet.client.enqueue(chat("hi", tokens=2), tenant="live")
    record = await fleet.client.result(live, timeout=10)
    assert record.status == "succeeded"
    assert await dispatch_wait(fleet, live) < 2
    counts = await Scheduler(fleet.redis, fleet.keys).counts()
    assert counts.tenants.get("batch", 0) > 200  # the backlog still waits
    for job_id in backlog:
        await fleet.client.cancel(job_id)
    await fleet.stop()


async def test_weights_shape_the_shares_and_high_priority_overtakes_a_low_backlog(
    fleet: Fleet,
) -> None:
    weights = json.dumps({"live": 3})
    await fleet.start(2, upstream_max_concurrent=4, tenant_weights=weights)
    quick = {"tokens": 4, "rate": 40.0}
    batch = await fleet.client.enqueue_many(
        [chat(f"b{i}", **quick) for i in range(40)], tenant="batch", priority="low"
    )
    live = await fleet.client.enqueue_many(
        [chat(f"l{i}", **quick) for i in range(40)], tenant="live"
    )
    urgent = await fleet.client.enqueue_many(
        [chat(f"u{i}", **quick) for i in range(3)], tenant="batch", priority="high"
    )
    await all_succeed(fleet, batch + live + urgent, 90)
    dispatched = {}
    for job_id in batch + live + urgent:
        record = await fleet.client.get(job_id)
        dispatched[job_id] = record.dispatched_at or 0.0
    order = sorted(dispatched, key=dispatched.__getitem__)
    first_forty = order[:40]
    live_share = sum(job_id in live for job_id in first_forty) / 40
    assert 0.6 <= live_share <= 0.9, live_share  # 3 : 1 -> 0.75
    later_batch = [job_id for job_id in batch if job_id not in order[:12]]
    assert max(dispatched[j] for j in urgent) < min(dispatched[j] for j in later_batch)
    await fleet.stop()


# -- state per tenant, bursts and bounds (issue 35) -----------------------------------------


async def test_tenants_that_came_and_went_leave_a_bounded_state(fleet: Fleet) -> None:
    """Two rounds of 6,000 jobs, each for a tenant never seen before (a tenant per end
    user): afterwards the scheduler keeps no count per tenant, and remembers at most
    LEFT_MAX (10,000) of the tenants that left, not every one ever seen."""
    await fleet.start(2, concurrency=64)
    sched = fleet.keys.sched(0)
    for round_ in range(2):
        ids: list[str] = []
        for start in range(0, 6_000, 20):
            ids += await asyncio.gather(
                *(
                    fleet.client.enqueue(chat("x", tokens=1), tenant=f"user-{round_}-{i}")
                    for i in range(start, start + 20)
                )
            )
        await all_succeed(fleet, ids, 240)
        counts = [str(field) for field in await fleet.redis.hgetall(sched + ":counts")]
        assert not [field for field in counts if field.startswith(("t:", "u:"))], len(counts)
        assert len(counts) <= 5, counts  # seq, vtime, waiting, rq
    assert await fleet.redis.zcard(sched + ":left") <= 10_000
    assert not await fleet.redis.exists(sched + ":last")
    left_over = [key async for key in fleet.redis.scan_iter(f"{sched}:*", count=1_000)]
    assert sorted(left_over) == sorted(
        f"{sched}:{name}" for name in ("config", "counts", "left")
    ), left_over
    await fleet.stop()


def busiest_window(times: list[float], seconds: float) -> int:
    """The most of ``times`` (sorted) inside any window of ``seconds``."""
    most, first = 0, 0
    for last, at in enumerate(times):
        while at - times[first] > seconds:
            first += 1
        most = max(most, last - first + 1)
    return most


async def test_a_requests_per_minute_limit_spreads_requests_over_the_minute(
    fleet: Fleet,
) -> None:
    """300 a minute and 60 jobs at once: no 6 s window holds more than a tenth of the
    minute's limit plus 10% (33), and a provider that counts per second answers no 429."""
    await fleet.start(2, concurrency=64, upstream_requests_per_minute=300)
    ids = await fleet.client.enqueue_many([chat(f"j{i}", tokens=2) for i in range(60)])
    await all_succeed(fleet, ids, 60)
    times = sorted(fleet.mock.request_times)
    assert len(times) == 60
    assert busiest_window(times, 6.0) <= 33, busiest_window(times, 6.0)
    assert busiest_window(times, 1.0) <= 8  # 5 a second, and a burst of half a second's
    assert times[-1] - times[0] >= 10  # spread: 60 at 5 a second
    await fleet.stop()


async def test_max_queued_bounds_a_tenants_waiting_jobs_exactly(fleet: Fleet) -> None:
    """No worker runs: 60 enqueues against CHATSTREAM_MAX_QUEUED=50 queue exactly 50 (the
    one a wake-up moved into the stream for a reader counts too)."""
    producer = Client(fleet.redis, prefix=fleet.keys.prefix, max_queued=50)
    accepted = 0
    for i in range(60):
        try:
            await producer.enqueue(chat(f"j{i}"), tenant="acme")
            accepted += 1
        except QueueFullError as exc:
            assert exc.waiting == 50
    assert accepted == 50
    counts = await queue_counts(fleet.redis, fleet.keys)
    assert counts.length + counts.scheduled == 50
