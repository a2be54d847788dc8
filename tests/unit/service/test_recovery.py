"""Crash recovery in process: leases, reclaim, fencing, duplicate entries, dead letters,
hand-backs, against the real redis-server.

Each test pins one guarantee of docs/reliability.md and fails without the mechanism that
provides it. Where a worker must die (SIGKILL, SIGSTOP) the workers are real ``chatstream
worker`` subprocesses: ``tests/system/test_recovery.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas.events import EventType
from tests.helpers.checks import (
    check_stream,
    eventually,
    merge_deltas,
    queue_is_drained,
    status_of,
    stream_entries,
)
from tests.helpers.harness import MOCK, Harness, chat, consuming
from worker.client import Client
from worker.protocol.accumulator import Delta
from worker.service import worker as worker_module
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


@pytest.mark.parametrize("given_up", ["failed", "hung"])
async def test_an_entry_served_to_a_read_given_up_on_runs_at_once(
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    monkeypatch: pytest.MonkeyPatch,
    given_up: str,
) -> None:
    """A partition: Redis served a queue read the worker had given up on (it failed, or it
    hung until redis-py's retry returned nothing), so the entry is the worker's, unseen.
    The worker looks for such entries as soon as Redis answers, not half a lease later
    (a lease of 60 s here: the half-lease sweep would come after the test's timeout)."""
    monkeypatch.setattr(worker_module, "STRAY_MIN_IDLE_MS", 0)  # found on the first look
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "lease_seconds": 60})
    keys, client = Keys(settings.prefix), Client.from_settings(settings, redis)
    worker = Worker(settings, redis)
    await worker.queue.ensure_group()
    job_id = await client.enqueue(chat("lost", key="lost"))
    real_read, reads = worker.queue.read, 0

    async def read_given_up_on(count: int, block_ms: int | None) -> list[Any]:
        nonlocal reads
        reads += 1
        if reads > 1:
            return await real_read(count, block_ms)
        lost: Any = await redis.xreadgroup(GROUP, worker.name, {keys.queue: ">"}, count=1)
        assert lost[0][1][0][1]["job"] == job_id  # delivered; the reply never came back
        if given_up == "failed":
            raise RedisConnectionError("the network is partitioned")
        await asyncio.sleep(0.2)  # longer than the block time (50 ms) and then some
        return []

    monkeypatch.setattr(worker.queue, "read", read_given_up_on)
    async with consuming(worker):
        record = await client.result(job_id, timeout=10)
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
    assert first == again
    assert first[:4] == ["started", 1, first[2], "default"]  # then created_at, trace context
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


# -- a renewal racing the job's own ack ------------------------------------------------------


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
