"""Crash recovery: leases, reclaim, fencing, duplicate entries, dead letters, hand-backs.

Each test pins one guarantee of docs/reliability.md and fails without the mechanism that
provides it. Worker processes are real ``chatstream worker`` subprocesses where a worker
must die (SIGKILL); the rest drive in-process workers against the real redis-server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

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
from tests.helpers.harness import MOCK, Harness, chat
from tests.helpers.processes import CHATSTREAM, WorkerProcesses, clean_env, stop_worker, worker_env
from tests.helpers.servers import RedisServer, needs_redis_server
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.protocol.accumulator import Delta
from worker.service.entries import HeldEntry
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.batch import PipelineSender
from worker.store.keys import GROUP, Keys
from worker.store.publisher import Publisher, Terminal
from worker.store.queue import Queue
from worker.store.records import Records
from worker.testing.mock_upstream import MockUpstream, expected_reply

# one at a time on one test process: their workers' leases and heartbeats run on real clocks
pytestmark = pytest.mark.xdist_group("worker-processes")

# -- helpers ----------------------------------------------------------------------------------


@asynccontextmanager
async def consuming(*workers: Worker) -> AsyncIterator[None]:
    """In-process workers consuming until the block exits, then shut down gracefully."""
    for worker in workers:
        await worker.startup()
    tasks = [asyncio.create_task(worker.consume()) for worker in workers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.shutdown()


# -- leases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("renew", [True, False], ids=["renewed", "without-renewal"])
async def test_a_job_outliving_its_lease_on_a_live_worker_runs_once(
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    monkeypatch: pytest.MonkeyPatch,
    renew: bool,
) -> None:
    """A 3 s job under a 1 s lease, a second worker polling for expired leases: the
    running worker renews its claim (every lease/3), so the job runs once. The control
    case switches renewal off and shows the second worker would take the job over."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "lease_seconds": 1.0})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    first, second = Worker(settings, redis, name="first"), Worker(settings, redis, name="second")
    if not renew:  # no renewal, nor any other way of taking its own idle entry back

        async def nothing(*args: Any) -> list[Any]:
            return []

        monkeypatch.setattr(first.upkeep, "renew_leases", nothing)
        monkeypatch.setattr(first.upkeep, "adopt_stranded", nothing)
        monkeypatch.setattr(first.queue, "reclaim", nothing)
    request = chat("slow", tokens=30, rate=10, key="slow")  # about 3 s
    job_id = await client.enqueue(request)
    async with consuming(first):
        await eventually(lambda: _is(redis, keys, job_id, "running"))
        async with consuming(second):
            record = await client.result(job_id, timeout=20)
    events = await stream_entries(redis, keys, job_id)
    check_stream(events, record)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, MOCK)
    if renew:
        assert record.attempt == 1
        assert record.worker == "first"
        assert mock.key_requests["slow"] == 1
        assert EventType.RESET not in [e.type for e in events]
    else:
        assert record.attempt >= 2
        assert record.worker == "second"
        assert mock.key_requests["slow"] >= 2
    assert await queue_is_drained(redis, keys)


async def _is(redis: Redis, keys: Keys, job_id: str, status: str) -> bool:
    return await status_of(redis, keys, job_id) == status


async def test_a_killed_workers_job_is_reclaimed_after_the_lease_and_rerun_with_a_reset(
    redis_server: RedisServer | None,
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> None:
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    lease = 2.0
    keys, client = Keys(settings.prefix), Client(redis, prefix=settings.prefix)
    env = worker_env(server.url, settings.prefix, url, lease_seconds=lease)
    request = chat("doomed", tokens=60, rate=30, key="doomed")  # about 2 s
    async with WorkerProcesses.session(tmp_path, env) as group:
        doomed = group.spawn()
        await group.ready(doomed, redis, keys)
        job_id = await client.enqueue(request)

        async def some_deltas() -> bool:
            return len(await stream_entries(redis, keys, job_id)) >= 3

        await eventually(some_deltas)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()
        killed_at = time.time()
        rescuer_settings = settings.model_copy(update={"upstream_url": url, "lease_seconds": lease})
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
    assert mock.key_requests["doomed"] == 2
    assert await queue_is_drained(redis, keys)


async def test_a_worker_does_not_run_its_own_reclaimed_entry_twice(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """A stalled worker may XAUTOCLAIM an entry it still runs; it must not start it again."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    request = chat("once", tokens=20, rate=20, key="once")  # about 1 s
    job_id = await client.enqueue(request)
    async with consuming(worker):
        await eventually(lambda: _is(redis, keys, job_id, "running"))
        [entry_id] = list(worker.running)
        # as if the event loop had stalled past the lease: the entry looks expired
        await redis.xclaim(keys.queue, GROUP, worker.name, 0, [entry_id], idle=60_000)

        async def reclaimed() -> bool:  # by the worker's own consume loop (XAUTOCLAIM)
            rows: Any = await redis.xpending_range(keys.queue, GROUP, "-", "+", 1)
            return bool(rows) and int(rows[0]["times_delivered"]) >= 2

        await eventually(reclaimed)
        assert list(worker.running) == [entry_id]
        record = await client.result(job_id, timeout=10)
    assert record.status == "succeeded"
    assert record.attempt == 1
    assert mock.key_requests["once"] == 1


# -- fencing ------------------------------------------------------------------------------


async def test_a_stale_attempt_cannot_touch_the_newer_attempts_record_or_stream(
    settings: Settings, redis: Redis
) -> None:
    keys = Keys(settings.prefix)
    client = Client.from_settings(settings, redis)
    records = Records(redis, keys, settings.retention_seconds)
    await records.load_scripts()
    publisher = Publisher(redis, records)
    publisher.start()
    try:
        job_id = await client.enqueue(chat("fenced"))
        first = await records.start(job_id, "w1", 5, "1-1")
        assert (first.state, first.attempt) == ("started", 1)
        old = publisher.open(job_id, 1)
        publisher.publish(old, Delta(role="assistant", content="old "))
        await eventually(lambda: _entries(redis, keys, job_id, 1))

        second = await records.start(job_id, "w2", 5, "1-1")  # the entry was taken over
        assert (second.state, second.attempt) == ("started", 2)
        before = await redis.xrange(keys.events(job_id))
        record_before = await records.fetch(job_id)

        # every kind of write the stale attempt can still make is refused
        publisher.publish(old, Delta(content="stale delta"))
        terminal = Terminal(
            "done", {"finish_reason": "stop", "usage": None}, _fields("stale result")
        )
        assert await publisher.finish(old, terminal) is False
        assert old.stale
        assert await records.release(job_id, 1) is False
        forged = records.delta_command(job_id, 1, 99, json.dumps({"content": "forged"}))
        assert await PipelineSender(redis).send([forged]) == [-1]
        assert await redis.xrange(keys.events(job_id)) == before
        assert await records.fetch(job_id) == record_before

        # the current attempt writes normally
        new = publisher.open(job_id, 2)
        publisher.publish(new, Delta(role="assistant", content="new"))
        final = Terminal("done", {"finish_reason": "stop", "usage": None}, _fields("new"))
        assert await publisher.finish(new, final) is True
    finally:
        await publisher.stop()
    record = await client.get(job_id)
    assert (record.status, record.attempt, record.content) == ("succeeded", 2, "new")
    events = await stream_entries(redis, keys, job_id)
    check_stream(events, record)
    assert [(e.type, e.attempt) for e in events] == [
        (EventType.DELTA, 1),
        (EventType.RESET, 2),
        (EventType.DELTA, 2),
        (EventType.DONE, 2),
    ]


def _fields(content: str) -> dict[str, str]:
    return {
        "status": "succeeded",
        "content": content,
        "finish_reason": "stop",
        "finished_at": f"{time.time():.6f}",
    }


async def _entries(redis: Redis, keys: Keys, job_id: str, count: int) -> bool:
    return int(await redis.xlen(keys.events(job_id))) >= count


async def test_a_delta_write_retried_after_a_lost_reply_is_applied_once(
    settings: Settings, redis: Redis
) -> None:
    keys = Keys(settings.prefix)
    records = Records(redis, keys, settings.retention_seconds)
    await records.load_scripts()
    job_id = await Client.from_settings(settings, redis).enqueue(chat("once"))
    await records.start(job_id, "w", 3, "1-1")
    for _ in range(2):  # the same batch twice, as after a reply lost to a Redis restart
        results = await PipelineSender(redis).send(
            [
                records.delta_command(job_id, 1, 1, json.dumps({"content": "a"})),
                records.delta_command(job_id, 1, 2, json.dumps({"content": "b"})),
            ]
        )
    assert results == [0, 0]
    events = await stream_entries(redis, keys, job_id)
    assert merge_deltas(events).content == "ab"


async def test_duplicate_queue_entries_of_a_job_run_it_once(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """Two entries for one job (a retried XADD, a racing enqueue): while the job runs
    under one entry, a start from the other is refused (``busy``) and that entry dropped."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    request = chat("dup", tokens=20, rate=40, key="dup")
    job_id = await client.enqueue(request)
    first, second = Worker(settings, redis), Worker(settings, redis)
    async with consuming(first):
        await eventually(lambda: _is(redis, keys, job_id, "running"))
        await Queue(redis, keys, "client").add(job_id)  # the duplicate
        async with consuming(second):
            record = await client.result(job_id, timeout=10)
            await eventually(lambda: queue_is_drained(redis, keys))
    assert (record.status, record.attempt) == ("succeeded", 1)
    assert mock.key_requests["dup"] == 1
    check_stream(await stream_entries(redis, keys, job_id), record)


async def test_an_entry_taken_over_by_another_worker_is_not_acked_by_the_old_owner(
    settings: Settings, redis: Redis
) -> None:
    keys = Keys(settings.prefix)
    old, new = Queue(redis, keys, "old"), Queue(redis, keys, "new")
    await old.ensure_group()
    await old.add("job-1")
    [entry] = await old.read(1, 10)
    [taken] = await new.reclaim(1, 0)
    assert taken.entry_id == entry.entry_id
    assert await old.ack(entry) is False
    assert await old.requeue(entry, "job-1") is None
    assert await old.renew([entry]) == [entry.ref]  # lost
    rows: Any = await redis.xpending_range(keys.queue, GROUP, "-", "+", 10)
    assert [(r["message_id"], r["consumer"]) for r in rows] == [(entry.entry_id, "new")]
    assert await redis.xlen(keys.queue) == 1
    assert await new.ack(taken) is True
    assert await queue_is_drained(redis, keys)


async def test_a_terminal_write_retried_after_it_landed_still_acks_the_entry(
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retried terminal write finds the job already finished by itself ("stale"): the
    entry is acked at once rather than left for a lease to expire."""
    _, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    real_finish = worker.publisher.finish

    async def finish_then_lose_the_reply(stream: Any, terminal: Terminal) -> bool:
        assert await real_finish(stream, terminal)
        return False

    monkeypatch.setattr(worker.publisher, "finish", finish_then_lose_the_reply)
    job_id = await client.enqueue(chat("retried"))
    await worker.startup()
    try:
        await worker.run_burst()
    finally:
        await worker.shutdown()
    assert (await client.get(job_id)).status == "succeeded"
    assert await queue_is_drained(redis, keys)


async def test_a_redis_error_while_starting_a_job_is_retried(
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    real_start = worker.records.start
    failures = [RedisConnectionError("Connection reset by peer")] * 2

    async def flaky_start(*args: Any, **kwargs: Any) -> Any:
        if len(failures) == 1:
            await real_start(*args, **kwargs)  # applied, but the reply is lost
        if failures:
            raise failures.pop()
        return await real_start(*args, **kwargs)

    monkeypatch.setattr(worker.records, "start", flaky_start)
    job_id = await client.enqueue(chat("flaky"))
    await worker.startup()
    try:
        await worker.run_burst()
    finally:
        await worker.shutdown()
    record = await client.get(job_id)
    assert (record.status, record.attempt) == ("succeeded", 1)  # the retry started no other
    assert await queue_is_drained(redis, keys)


# -- hand-backs ---------------------------------------------------------------------------


async def test_entries_held_but_not_running_at_shutdown_are_handed_back_at_once(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """A read cut short by shutdown (entries delivered, no task yet) and a start cut short
    (the attempt began in Redis, its task was cancelled): both go back to the queue at
    shutdown, and another worker runs them without waiting for a lease to expire."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "lease_seconds": 60})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    unread, unstarted = chat("unread", key="unread"), chat("unstarted", key="unstarted")
    unread_id = await client.enqueue(unread)
    unstarted_id = await client.enqueue(unstarted)
    leaving = Worker(settings, redis)
    await leaving.startup()
    entries = await leaving.queue.read(2, 10)
    assert [e.job_id for e in entries] == [unread_id, unstarted_id]
    begun = await leaving.records.start(unstarted_id, leaving.name, 3, entries[1].entry_id)
    assert begun.attempt == 1
    await leaving.shutdown()

    assert await leaving.queue.owned() == []
    assert await redis.xlen(keys.queue) == 2  # two fresh entries
    assert await status_of(redis, keys, unstarted_id) == "queued"
    taking_over = Worker(settings, redis)
    await taking_over.startup()
    try:
        started = time.monotonic()
        assert await taking_over.run_burst() == 2
        assert time.monotonic() - started < 5  # not after the 60 s lease
    finally:
        await taking_over.shutdown()
    for job_id, request, attempt in ((unread_id, unread, 1), (unstarted_id, unstarted, 2)):
        record = await client.get(job_id)
        assert (record.status, record.attempt) == ("succeeded", attempt)
        assert record.content == expected_reply(request, MOCK)
        check_stream(await stream_entries(redis, keys, job_id), record)
    assert mock.key_requests == {"unread": 1, "unstarted": 1}
    assert await queue_is_drained(redis, keys)
    consumers: Any = await redis.xinfo_consumers(keys.queue, GROUP)
    assert leaving.name not in [c["name"] for c in consumers]  # left the group cleanly


async def test_a_release_of_a_stale_attempt_is_refused(settings: Settings, redis: Redis) -> None:
    keys = Keys(settings.prefix)
    records = Records(redis, keys, settings.retention_seconds)
    job_id = await Client.from_settings(settings, redis).enqueue(chat("r"))
    await records.start(job_id, "w1", 5, "1-1")
    assert await records.release(job_id, 1) is True
    assert await records.release(job_id, 1) is True  # a retry after a lost reply
    await records.start(job_id, "w2", 5, "2-1")
    assert await records.release(job_id, 1) is False
    assert await records.hand_back(job_id, "1-1") is False  # runs under another entry
    assert (await records.fetch(job_id))["status"] == "running"


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


async def test_an_exhausted_job_is_dead_lettered_even_if_the_first_reply_was_lost(
    settings: Settings, redis: Redis
) -> None:
    """The record goes failed in the start script; the dead-letter entry is written after.
    Whoever next meets the entry writes it if it is still missing (``dead_pending``)."""
    keys = Keys(settings.prefix)
    records = Records(redis, keys, settings.retention_seconds)
    job_id = await Client.from_settings(settings, redis).enqueue(chat("p"))
    await records.start(job_id, "w", 1, "1-1")
    exhausted = await records.start(job_id, "w", 1, "1-1")
    assert (exhausted.state, exhausted.dead_pending) == ("exhausted", True)
    # the reply was lost: the retry finds the job terminal, the dead letter still due
    retried = await records.start(job_id, "w", 1, "1-1")
    assert (retried.state, retried.dead_pending) == ("terminal", True)
    worker = Worker(settings, redis)
    await worker.fate.dead_letter(job_id, retried.attempt)
    again = await records.start(job_id, "w", 1, "1-1")
    assert (again.state, again.dead_pending) == ("terminal", False)
    assert await redis.xlen(keys.dead) == 1


async def test_an_entry_whose_delivery_reply_was_lost_runs_within_half_a_lease(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """XREADGROUP delivered an entry (it is in our pending list) but the reply was lost to
    a Redis restart: the worker never saw it. It adopts it after half a lease instead of
    leaving it for a reclaim after the whole lease."""
    mock, url = mock_upstream
    lease = 4.0
    settings = settings.model_copy(update={"upstream_url": url, "lease_seconds": lease})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    await worker.queue.ensure_group()
    job_id = await client.enqueue(chat("lost", key="lost"))
    lost: Any = await redis.xreadgroup(GROUP, worker.name, {keys.queue: ">"}, count=1)
    assert lost and lost[0][1][0][1]["job"] == job_id
    delivered = time.monotonic()
    async with consuming(worker):
        record = await client.result(job_id, timeout=10)
    took = time.monotonic() - delivered
    assert lease / 2 - 0.2 <= took < lease - 0.5
    assert (record.status, record.attempt, record.worker) == ("succeeded", 1, worker.name)
    assert mock.key_requests["lost"] == 1
    assert await queue_is_drained(redis, keys)


async def test_a_start_retried_after_a_lost_reply_starts_no_second_attempt(
    settings: Settings, redis: Redis
) -> None:
    """redis-py resends a command whose reply was lost; the start script recognises its
    own token and answers the attempt it already started (no extra attempt, no reset)."""
    keys = Keys(settings.prefix)
    records = Records(redis, keys, settings.retention_seconds)
    job_id = await Client.from_settings(settings, redis).enqueue(chat("s"))
    now = f"{time.time():.6f}"
    args: list[str | int] = ["w", now, 3, settings.retention_seconds, "1-1", 1, "t1", ""]
    first = await records._start(keys=records.job_keys(job_id), args=args)
    again = await records._start(keys=records.job_keys(job_id), args=args)
    assert first == again == ["started", 1, first[2], "default"]
    assert await redis.xlen(keys.events(job_id)) == 0  # no reset
    other = await records.start(job_id, "w", 3, "1-1")  # a genuinely new start
    assert other.attempt == 2


async def test_consumers_of_dead_workers_are_pruned_but_not_those_holding_entries(
    settings: Settings, redis: Redis
) -> None:
    keys = Keys(settings.prefix)
    alive, holding = Queue(redis, keys, "alive"), Queue(redis, keys, "holding")
    await alive.ensure_group()
    await redis.xgroup_createconsumer(keys.queue, GROUP, "dead")
    await holding.add("job-1")
    await holding.read(1, 10)
    await asyncio.sleep(0.05)
    assert await alive.prune(idle_ms=20) == 1
    consumers: Any = await redis.xinfo_consumers(keys.queue, GROUP)
    assert sorted(c["name"] for c in consumers) == ["holding"]  # "alive" never read yet
    assert await holding.prune(idle_ms=60_000) == 0


# -- frozen and stalled workers (SIGSTOP / SIGCONT) -------------------------------------------


def check_exact(request: dict[str, Any], record: JobRecord, events: list[StreamEvent]) -> None:
    """Succeeded with exactly the expected reply; one ``reset`` per rerun; the stream exact."""
    assert record.status == "succeeded", (record.id, record.error)
    assert record.content == expected_reply(request, MOCK), record.id
    check_stream(events, record)
    assert [e.type for e in events].count(EventType.RESET) == record.attempt - 1, record.id


async def consumer_of(redis: Redis, keys: Keys, process: Any) -> str:
    """The consumer (worker) name of a ``chatstream worker`` process."""
    names = await redis.zrange(keys.workers, 0, -1)
    [name] = [str(n) for n in names if f"-{process.pid}-" in str(n)]
    return name


async def entries_of(redis: Redis, keys: Keys, consumer: str) -> list[str]:
    rows: Any = await redis.xpending_range(keys.queue, GROUP, "-", "+", 1000, consumer)
    return [str(row["message_id"]) for row in rows]


async def jobs_running_on(redis: Redis, keys: Keys, consumer: str) -> dict[str, int]:
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
    redis_server: RedisServer | None,
    redis: Redis,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
    lease: float,
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
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    keys, client = Keys(prefix), Client(redis, prefix=prefix)
    # the default block: a read stays blocked (and is served while frozen) for up to 2 s
    env = worker_env(
        server.url,
        prefix,
        url,
        lease_seconds=lease,
        heartbeat_timeout=FROZEN_HEARTBEAT_TIMEOUT,
        concurrency=16,
        block_ms=2000,
    )
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

    async with WorkerProcesses.session(tmp_path, env) as group:
        workers = [group.spawn() for _ in range(3)]
        for process in workers:
            await group.ready(process, redis, keys)
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
        output = group.output()
        live_output = "\n".join(log.read_text() for log in group.logs[1:])
    assert codes == [0, 0, 0], output
    assert "Traceback" not in output, output
    assert was_running, "the frozen worker ran no job"
    assert delivered_while_frozen, "no entry was delivered to the frozen worker's read"
    for symptom in ("lease lost", "terminal write refused", "was never seen", "superseded"):
        assert symptom not in live_output, output  # no live attempt was ever replaced
    for request, job_id in zip(requests, ids, strict=True):
        record = await client.get(job_id)
        check_exact(request, record, await stream_entries(redis, keys, job_id))
        calls = mock.key_requests[request["mock"]["key"]]
        if job_id in was_running:
            assert record.attempt <= 2 and calls == record.attempt, (job_id, record.attempt)
        else:  # includes the jobs delivered to the frozen worker: run once, by a live one
            assert (record.attempt, calls) == (1, 1), (job_id, job_id in delivered_while_frozen)
    assert await queue_is_drained(redis, keys)


@pytest.mark.slow
@pytest.mark.parametrize("stall", [1.0, 4.5], ids=["brief-stall", "stall-past-the-timeout"])
async def test_a_stalled_worker_keeps_its_jobs_unless_it_stalls_past_the_heartbeat_timeout(
    redis_server: RedisServer | None,
    redis: Redis,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
    stall: float,
) -> None:
    """Default heartbeat settings (every 1 s, dead after 3 s). A worker whose event loop
    stalls for 1 s while streaming keeps its jobs: one attempt, one upstream call each. One
    that stalls for 4.5 s is declared dead and its jobs are rerun by the other worker; fencing
    keeps every result exact (the stalled attempts' late writes are refused)."""
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    keys, client = Keys(prefix), Client(redis, prefix=prefix)
    env = worker_env(server.url, prefix, url)
    async with WorkerProcesses.session(tmp_path, env) as group:
        stalling = group.spawn()
        await group.ready(stalling, redis, keys)
        name = await consumer_of(redis, keys, stalling)
        # 7 s: they still stream once the other worker had time to start judging
        requests = [chat(f"s{i}", tokens=42, rate=6, key=f"s{i}") for i in range(4)]
        ids = [await client.enqueue(request) for request in requests]
        await eventually(lambda: _all_running(redis, keys, ids))
        other = group.spawn()
        await group.ready(other, redis, keys)
        await asyncio.sleep(3.5)  # the other worker judges once it beat for the timeout
        os.kill(stalling.pid, signal.SIGSTOP)
        await asyncio.sleep(stall)
        os.kill(stalling.pid, signal.SIGCONT)
        assert await _all_running(redis, keys, ids)
        await eventually(lambda: all_terminal(redis, keys, ids), 40, every=0.2)
        codes = [await stop_worker(process, 15) for process in (stalling, other)]
        output = group.output()
    assert codes == [0, 0], output
    for request, job_id in zip(requests, ids, strict=True):
        record = await client.get(job_id)
        check_exact(request, record, await stream_entries(redis, keys, job_id))
        calls = mock.key_requests[request["mock"]["key"]]
        if stall < 3:
            assert (record.attempt, record.worker, calls) == (1, name, 1), output
        else:
            assert (record.attempt, calls) == (2, 2), output
            assert record.worker != name
    assert await queue_is_drained(redis, keys)


async def _all_running(redis: Redis, keys: Keys, ids: list[str]) -> bool:
    return all([await _is(redis, keys, job_id, "running") for job_id in ids])


@pytest.mark.parametrize("settling", [True, False], ids=["acked-by-its-own-task", "vanished"])
async def test_a_renewal_that_misses_an_entry_its_own_task_just_acked_loses_nothing(
    harness: Harness, settling: bool
) -> None:
    """A renewal's list of entries is taken before it runs; an entry acked meanwhile by the
    job's own task (its terminal write done) is not a lease lost to another worker. One that
    vanished while its job still runs (Redis restarted empty) is, and the job stops."""
    worker = harness.worker
    await harness.client.enqueue(chat("renewed"))
    [entry] = await worker.queue.read(1, None)
    task = asyncio.create_task(asyncio.sleep(30))
    worker.running[entry.ref] = HeldEntry(entry, task, claimed=True, settling=settling)
    try:
        assert await worker.queue.ack(entry)
        await worker.upkeep.renew_leases()
        assert worker.running[entry.ref].lost is not settling
        await asyncio.sleep(0)
        assert task.cancelled() is not settling
    finally:
        del worker.running[entry.ref]
        task.cancel()
