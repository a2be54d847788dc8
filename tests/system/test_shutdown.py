"""Graceful shutdown of ``chatstream worker`` processes (real subprocesses and signals).

SIGTERM or SIGINT: stop taking jobs, let running ones finish within the grace period,
then release the rest to the queue so another worker reruns them at once (not after the
lease expires); exit 0. A second signal exits at once, non-zero; its jobs are reclaimed
after the lease like a crashed worker's.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from typing import Any

import pytest

from schemas.events import EventType
from tests.helpers.checks import (
    after_last_reset,
    check_stream,
    eventually,
    merge_deltas,
    queue_is_drained,
    stream_entries,
)
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK, chat
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import expected_reply


def short_job(i: int) -> dict[str, Any]:
    return chat(f"short {i}", tokens=20, rate=40, key=f"short-{i}")  # about 0.5 s


def long_job(i: int) -> dict[str, Any]:
    """Stalls for 60 s after 5 tokens on its first run; the rerun streams at once."""
    return chat(
        f"long {i}",
        tokens=20,
        fault="stall",
        fault_after=5,
        stall_seconds=60,
        fail_times=1,
        key=f"long-{i}",
    )


async def exit_code(process: subprocess.Popen[bytes], timeout: float) -> int:
    return await asyncio.to_thread(process.wait, timeout)


async def all_running_on(redis: RedisClient, keys: Keys, ids: list[str], pid: int) -> bool:
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), ["status", "worker", "seq"])
    rows = await pipe.execute()
    return all(
        status == "running" and f"-{pid}-" in (worker or "") and int(seq or 0) > 0
        for status, worker, seq in rows
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_drains_the_worker_and_another_reruns_the_rest_at_once(
    fleet: Fleet, signum: signal.Signals
) -> None:
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    lease, grace = 60, 1.5
    fleet.configure(lease_seconds=lease, shutdown_grace_seconds=grace)
    shorts = [short_job(i) for i in range(3)]
    longs = [long_job(i) for i in range(3)]
    [leaving] = await fleet.start()
    short_ids = [await client.enqueue(r) for r in shorts]
    long_ids = [await client.enqueue(r) for r in longs]
    await eventually(lambda: all_running_on(redis, keys, short_ids + long_ids, leaving.pid))
    [staying] = await fleet.start()

    signalled = time.monotonic()
    leaving.send_signal(signum)
    assert await exit_code(leaving, timeout=grace + 8) == 0, fleet.output()
    exited = time.monotonic() - signalled
    records = [await client.result(job_id, timeout=20) for job_id in long_ids]
    rerun = time.monotonic() - signalled
    assert staying.poll() is None
    staying.send_signal(signal.SIGTERM)
    assert await exit_code(staying, timeout=10) == 0, fleet.output()

    output = fleet.output()
    assert "Traceback" not in output, output
    assert grace - 0.2 <= exited <= grace + 5, output  # waited for the grace period only
    assert rerun < 15, output  # at once: far from the 60 s lease
    assert "released 3 unfinished jobs" in output
    for request, job_id in zip(shorts, short_ids, strict=True):
        record = await client.get(job_id)
        assert (record.status, record.attempt) == ("succeeded", 1)  # finished in the grace
        assert f"-{leaving.pid}-" in (record.worker or "")
        assert record.content == expected_reply(request, MOCK)
        check_stream(await stream_entries(redis, keys, job_id), record)
    for i, (request, record) in enumerate(zip(longs, records, strict=True)):
        assert (record.status, record.attempt) == ("succeeded", 2), record.error
        assert f"-{staying.pid}-" in (record.worker or "")
        assert record.content == expected_reply(request, MOCK)
        events = await stream_entries(redis, keys, record.id)
        check_stream(events, record)
        types = [e.type for e in events]
        assert types.count(EventType.RESET) == 1
        assert EventType.DELTA in types[: types.index(EventType.RESET)]  # attempt 1 had output
        assert {e.attempt for e in after_last_reset(events)} == {2}
        assert merge_deltas(events).content == record.content
        assert fleet.mock.key_requests[f"long-{i}"] == 2
    assert await queue_is_drained(redis, keys)
    assert await redis.zcard(keys.workers) == 0  # both left


async def test_a_second_signal_exits_at_once_and_the_job_is_reclaimed_later(
    fleet: Fleet,
) -> None:
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    lease = 2
    fleet.configure(lease_seconds=lease, shutdown_grace_seconds=30)
    request = long_job(0)
    [impatient] = await fleet.start()
    job_id = await client.enqueue(request)
    await eventually(lambda: all_running_on(redis, keys, [job_id], impatient.pid))
    impatient.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.5)
    assert impatient.poll() is None  # draining: the grace period is 30 s
    signalled = time.monotonic()
    impatient.send_signal(signal.SIGTERM)
    code = await exit_code(impatient, timeout=5)
    assert code != 0
    assert time.monotonic() - signalled < 2
    assert await redis.hget(keys.job(job_id), "status") == "running"  # not released

    [rescuer] = await fleet.start(lease_seconds=lease)
    record = await client.result(job_id, timeout=20)
    rescuer.send_signal(signal.SIGTERM)
    assert await exit_code(rescuer, timeout=10) == 0
    assert "second signal" in fleet.output()
    assert (record.status, record.attempt) == ("succeeded", 2)
    assert record.content == expected_reply(request, MOCK)
    check_stream(await stream_entries(redis, keys, job_id), record)
    assert fleet.mock.key_requests["long-0"] == 2
    assert await queue_is_drained(redis, keys)


async def test_an_idle_worker_blocked_on_the_queue_stops_at_once(fleet: Fleet) -> None:
    [idle] = await fleet.start(block_ms=10_000)
    await asyncio.sleep(0.3)  # inside its blocking XREADGROUP
    signalled = time.monotonic()
    idle.send_signal(signal.SIGTERM)
    assert await exit_code(idle, timeout=5) == 0, fleet.output()
    assert time.monotonic() - signalled < 2
    assert "Traceback" not in fleet.output()
