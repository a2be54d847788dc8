"""Crash recovery on real ``chatstream worker`` subprocesses: a worker SIGKILLed mid-job,
workers that keep dying (dead letters, ``chatstream dead --requeue``), a worker frozen
(SIGSTOP) or stalled past its heartbeat timeout.

Each test pins one guarantee of docs/reliability.md and fails without the mechanism that
provides it. The in-process cases (leases, fencing, duplicate entries, hand-backs) are in
``tests/unit/service/test_recovery.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.checks import (
    after_last_reset,
    all_terminal,
    check_stream,
    eventually,
    merge_deltas,
    queue_is_drained,
    status_of,
    stream_entries,
)
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK, chat, consuming
from tests.helpers.processes import CHATSTREAM, clean_env, stop_worker
from tests.helpers.servers import RedisServer, needs_redis_server
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.keys import GROUP, Keys
from worker.store.queue import Queue
from worker.store.records import Records
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockUpstream, expected_reply

# one at a time on one test process: their workers' leases and heartbeats run on real clocks
pytestmark = pytest.mark.xdist_group("worker-processes")

# -- a killed worker --------------------------------------------------------------------------


async def test_a_killed_workers_job_is_reclaimed_after_the_lease_and_rerun_with_a_reset(
    fleet: Fleet, settings: Settings
) -> None:
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    lease = 2.0
    request = chat("doomed", tokens=60, rate=30, key="doomed")  # about 2 s
    [doomed] = await fleet.start(lease_seconds=lease)
    job_id = await client.enqueue(request)

    async def some_deltas() -> bool:
        return len(await stream_entries(redis, keys, job_id)) >= 3

    await eventually(some_deltas)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    killed_at = time.time()
    rescuer_settings = settings.model_copy(
        update={"upstream_url": fleet.upstream_url, "lease_seconds": lease}
    )
    rescuer = Worker(rescuer_settings, redis)
    async with consuming(rescuer):
        record = await client.result(job_id, timeout=20)

    events = await stream_entries(redis, keys, job_id)
    check_stream(events, record)
    assert record.status == "succeeded"
    assert record.attempt == 2
    assert record.worker == rescuer.name
    [reset] = [e for e in events if e.type is EventType.RESET]
    before = events[: events.index(reset)]
    assert before and {(e.type, e.attempt) for e in before} == {(EventType.DELTA, 1)}
    after = after_last_reset(events)
    assert {e.attempt for e in after} == {2}
    assert merge_deltas(events).content == record.content == expected_reply(request, MOCK)
    # taken over only once the lease ran out: the last renewal was at most lease/3 ago
    reclaimed_at = int(reset.id.split("-")[0]) / 1000
    assert lease * 2 / 3 - 0.2 <= reclaimed_at - killed_at <= lease + 2.0
    assert fleet.mock.key_requests["doomed"] == 2
    assert await queue_is_drained(redis, keys)


# -- attempts exhausted, dead letters -------------------------------------------------------


async def test_a_job_whose_workers_keep_dying_is_dead_lettered_and_can_be_requeued(
    redis_server: RedisServer | None,
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> None:
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    lease = 0.3
    settings = settings.model_copy(
        update={"upstream_url": url, "lease_seconds": lease, "max_attempts": 2}
    )
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    records = Records(redis, keys, settings.retention_seconds)
    request = chat("poison", key="poison")
    job_id = await client.enqueue(request)
    await Queue(redis, keys, "x").ensure_group()
    for n in (1, 2):  # two workers start the job and die without a trace
        dying = Queue(redis, keys, f"dying-{n}")
        [entry] = await (dying.read(1, 10) if n == 1 else dying.reclaim(1, int(lease * 1000)))
        assert (await records.start(job_id, dying.consumer, 2, entry.entry_id)).attempt == n
        await asyncio.sleep(lease + 0.05)

    worker = Worker(settings, redis)
    await worker.startup()
    try:
        await worker.run_burst()
    finally:
        await worker.shutdown()
    record = await client.get(job_id)
    assert record.status == "failed"
    assert record.error is not None and record.error["code"] == "attempts_exhausted"
    assert record.attempt == 2
    check_stream(await stream_entries(redis, keys, job_id), record)
    assert mock.key_requests["poison"] == 0
    assert await queue_is_drained(redis, keys)
    [letter] = await client.dead_letters()
    assert letter.job_id == job_id and letter.reason["code"] == "attempts_exhausted"

    env = {
        **clean_env(),
        "CHATSTREAM_REDIS_URL": server.url,
        "CHATSTREAM_PREFIX": settings.prefix,
    }
    listed = await _cli(env, tmp_path, "dead", "--json")
    assert [json.loads(line)["job"] for line in listed.splitlines()] == [job_id]
    assert job_id in await _cli(env, tmp_path, "dead")
    assert (await _cli(env, tmp_path, "dead", "--requeue", job_id)).strip() == "requeued"
    assert await _cli(env, tmp_path, "dead", "--json") == ""
    refused = await _cli(env, tmp_path, "dead", "--requeue", job_id, expect=1)
    assert "queued" in refused

    worker = Worker(settings, redis)
    await worker.startup()
    try:
        await worker.run_burst()
    finally:
        await worker.shutdown()
    record = await client.get(job_id)
    assert (record.status, record.attempt) == ("succeeded", 3)  # the counter stays monotonic
    assert record.content == expected_reply(request, MOCK)
    events = await stream_entries(redis, keys, job_id)
    check_stream(events, record)
    assert events[0].type is EventType.RESET  # the failed run's stream was void
    assert await redis.xlen(keys.dead) == 0
    assert await queue_is_drained(redis, keys)


async def _cli(env: dict[str, str], cwd: Path, *args: str, expect: int = 0) -> str:
    process = await asyncio.create_subprocess_exec(
        CHATSTREAM,
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == expect, err.decode()
    return (out if expect == 0 else err).decode()


# -- frozen and stalled workers (SIGSTOP / SIGCONT) -------------------------------------------


def check_exact(request: dict[str, Any], record: JobRecord, events: list[StreamEvent]) -> None:
    """Succeeded with exactly the expected reply; one ``reset`` per rerun; the stream exact."""
    assert record.status == "succeeded", (record.id, record.error)
    assert record.content == expected_reply(request, MOCK), record.id
    check_stream(events, record)
    assert [e.type for e in events].count(EventType.RESET) == record.attempt - 1, record.id


async def consumer_of(redis: RedisClient, keys: Keys, process: Any) -> str:
    """The consumer (worker) name of a ``chatstream worker`` process."""
    names = await redis.zrange(keys.workers, 0, -1)
    [name] = [str(n) for n in names if f"-{process.pid}-" in str(n)]
    return name


async def entries_of(redis: RedisClient, keys: Keys, consumer: str) -> list[str]:
    rows: Any = await redis.xpending_range(keys.queue, GROUP, "-", "+", 1000, consumer)
    return [str(row["message_id"]) for row in rows]


async def jobs_running_on(redis: RedisClient, keys: Keys, consumer: str) -> dict[str, int]:
    """Job id -> attempt of the jobs whose record says ``consumer`` runs them."""
    found: dict[str, int] = {}
    for entry_id in await entries_of(redis, keys, consumer):
        rows: Any = await redis.xrange(keys.queue, entry_id, entry_id)
        job_id = str(rows[0][1]["job"]) if rows else ""
        record: Any = await redis.hgetall(keys.job(job_id)) if job_id else {}
        if record.get("status") == "running" and record.get("worker") == consumer:
            found[job_id] = int(record["attempt"])
    return found


def arriving_request(i: int) -> dict[str, Any]:
    """About 1 s each; one in five takes 3 s."""
    if i % 5 == 0:
        return chat(f"long {i}", tokens=30, rate=10, key=f"f{i}")
    return chat(f"job {i}", tokens=20, rate=20, key=f"f{i}")


FROZEN_HEARTBEAT_TIMEOUT = 4.0
FROZEN_FOR = 11.0  # past the heartbeat timeout and two short leases


@pytest.mark.slow
@pytest.mark.parametrize("lease", [5.0, 30.0], ids=["freeze-of-two-leases", "default-lease"])
async def test_a_frozen_worker_woken_up_never_restarts_a_job_a_live_worker_runs(
    fleet: Fleet, lease: float
) -> None:
    """Three workers, jobs arriving every 50 ms; one is frozen (SIGSTOP) for 11 s, which is
    past its heartbeat timeout (4 s here) and, with the short lease (5 s), two leases. A
    live worker keeps its jobs through a stall shorter than both (it renews every lease/3):
    4 s, not the default 3 s, leave room for the stalls of a busy machine (in a full CI run
    on 2 cores a live worker once stalled past 3 s), and the lease stays longer than the
    heartbeat timeout, as by default, so the frozen worker's jobs are taken over by its
    heartbeat before their leases run out (with the two equal, both ways raced in a CI run
    and a live worker's lease was reported lost). Its blocked
    queue read is served while it is frozen. The jobs it ran are taken over once (attempt 2);
    when it wakes it starts nothing from its late read and supersedes no live attempt: every
    other job runs once, attempt 1, one upstream call."""
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    requests: list[dict[str, Any]] = []
    ids: list[str] = []
    flowing = asyncio.Event()
    flowing.set()

    async def keep_enqueueing() -> None:
        while True:
            await flowing.wait()
            request = arriving_request(len(requests))
            ids.append(await client.enqueue(request))
            requests.append(request)
            await asyncio.sleep(0.05)

    # the default block: a read stays blocked (and is served while frozen) for up to 2 s
    workers = await fleet.start(
        3,
        lease_seconds=lease,
        heartbeat_timeout=FROZEN_HEARTBEAT_TIMEOUT,
        concurrency=16,
        block_ms=2000,
    )
    await asyncio.sleep(FROZEN_HEARTBEAT_TIMEOUT + 0.5)  # then workers judge each other
    arriving = asyncio.create_task(keep_enqueueing())
    await asyncio.sleep(2)
    victim = workers[0]
    name = await consumer_of(redis, keys, victim)
    flowing.clear()
    await asyncio.sleep(0.3)  # no entry for a while: every worker blocks in its read
    os.kill(victim.pid, signal.SIGSTOP)
    frozen_at_ms = int(time.time() * 1000)
    await asyncio.sleep(0.05)  # a start it sent just before is applied by now
    was_running = await jobs_running_on(redis, keys, name)
    flowing.set()  # the next entries go to the blocked reads in turn, the frozen one's too
    delivered_while_frozen: set[str] = set()  # job ids
    for _ in range(int(FROZEN_FOR * 10)):
        for entry_id in await entries_of(redis, keys, name):
            if int(entry_id.split("-")[0]) > frozen_at_ms + 50:
                rows: Any = await redis.xrange(keys.queue, entry_id, entry_id)
                delivered_while_frozen.update(row[1]["job"] for row in rows)
        await asyncio.sleep(0.1)
    os.kill(victim.pid, signal.SIGCONT)
    await asyncio.sleep(2)
    await cancel_and_wait([arriving])  # (redis-py can swallow one cancel: see its doc)
    await eventually(lambda: all_terminal(redis, keys, ids), 30, every=0.2)
    codes = [await stop_worker(process, 15) for process in workers]
    output = fleet.output()
    live_output = "\n".join(log.read_text() for log in fleet.logs[1:])
    assert codes == [0, 0, 0], output
    assert "Traceback" not in output, output
    assert was_running, "the frozen worker ran no job"
    assert delivered_while_frozen, "no entry was delivered to the frozen worker's read"
    for symptom in ("lease lost", "terminal write refused", "was never seen", "superseded"):
        assert symptom not in live_output, output  # no live attempt was ever replaced
    for request, job_id in zip(requests, ids, strict=True):
        record = await client.get(job_id)
        check_exact(request, record, await stream_entries(redis, keys, job_id))
        calls = fleet.mock.key_requests[request["mock"]["key"]]
        if job_id in was_running:
            assert record.attempt <= 2 and calls == record.attempt, (job_id, record.attempt)
        else:  # includes the jobs delivered to the frozen worker: run once, by a live one
            assert (record.attempt, calls) == (1, 1), (job_id, job_id in delivered_while_frozen)
    assert await queue_is_drained(redis, keys)


@pytest.mark.slow
@pytest.mark.parametrize("stall", [1.0, 4.5], ids=["brief-stall", "stall-past-the-timeout"])
async def test_a_stalled_worker_keeps_its_jobs_unless_it_stalls_past_the_heartbeat_timeout(
    fleet: Fleet, stall: float
) -> None:
    """Default heartbeat settings (every 1 s, dead after 3 s). A worker whose event loop
    stalls for 1 s while streaming keeps its jobs: one attempt, one upstream call each. One
    that stalls for 4.5 s is declared dead and its jobs are rerun by the other worker; fencing
    keeps every result exact (the stalled attempts' late writes are refused)."""
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    [stalling] = await fleet.start()
    name = await consumer_of(redis, keys, stalling)
    # 7 s: they still stream once the other worker had time to start judging
    requests = [chat(f"s{i}", tokens=42, rate=6, key=f"s{i}") for i in range(4)]
    ids = [await client.enqueue(request) for request in requests]
    await eventually(lambda: _all_running(redis, keys, ids))
    [other] = await fleet.start()
    await asyncio.sleep(3.5)  # the other worker judges once it beat for the timeout
    os.kill(stalling.pid, signal.SIGSTOP)
    await asyncio.sleep(stall)
    os.kill(stalling.pid, signal.SIGCONT)
    assert await _all_running(redis, keys, ids)
    await eventually(lambda: all_terminal(redis, keys, ids), 40, every=0.2)
    codes = [await stop_worker(process, 15) for process in (stalling, other)]
    output = fleet.output()
    assert codes == [0, 0], output
    for request, job_id in zip(requests, ids, strict=True):
        record = await client.get(job_id)
        check_exact(request, record, await stream_entries(redis, keys, job_id))
        calls = fleet.mock.key_requests[request["mock"]["key"]]
        if stall < 3:
            assert (record.attempt, record.worker, calls) == (1, name, 1), output
        else:
            assert (record.attempt, calls) == (2, 2), output
            assert record.worker != name
    assert await queue_is_drained(redis, keys)


async def _all_running(redis: RedisClient, keys: Keys, ids: list[str]) -> bool:
    return all([await status_of(redis, keys, job_id) == "running" for job_id in ids])
