"""EntryFate (worker/service/entries.py) on its own: what becomes of a held queue entry once
its attempt is over, or never started, on real Queue/Records/Replication objects and the
session's redis-server, without a worker.

An entry ends ``left`` (still pending: not ours to ack, or to be checked again), ``acked``
(gone) or ``requeued`` (gone, a fresh entry of its job waits in the queue)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.harness import chat
from worker.client import Client
from worker.service.entries import EntryFate, HeldEntry
from worker.service.metrics import Metrics
from worker.service.pipeline import Attempt, Outcome
from worker.settings import Settings
from worker.store.keys import GROUP, Keys
from worker.store.publisher import JobStream
from worker.store.queue import Entry, Queue
from worker.store.records import Records, Started
from worker.store.replication import Replication


@dataclass
class Jobs:
    """A consumer ``w`` with its EntryFate, and jobs queued for it by a real client."""

    redis: Redis
    keys: Keys
    client: Client
    fate: EntryFate

    @property
    def queue(self) -> Queue:
        return self.fate.queue

    @property
    def records(self) -> Records:
        return self.fate.records

    async def entry(self, job_id: str | None = None) -> Entry:
        """A job enqueued (a queue entry only, for an id given) and its entry read by ``w``."""
        if job_id is None:
            await self.client.enqueue(chat())
        else:
            await self.queue.add(job_id)
        [entry] = await self.queue.read(1, None)
        return entry

    async def start(self, entry: Entry, delivery: int = 1, max_attempts: int = 3) -> Started:
        return await self.records.start(
            entry.job_id or "", "w", max_attempts, entry.ref, delivery=delivery
        )

    async def end_of(self, entry: Entry) -> str:
        rows: Any = await self.redis.xrange(self.keys.queue)
        pending: Any = await self.redis.xpending_range(self.keys.queue, GROUP, "-", "+", 100)
        held = {row["message_id"] for row in pending}
        if entry.entry_id in held:
            return "left"
        if entry.entry_id in {entry_id for entry_id, _ in rows}:
            return "acked but not deleted"
        jobs = {fields["job"] for entry_id, fields in rows if entry_id not in held}
        return "requeued" if entry.job_id in jobs else "acked"

    async def record(self, job_id: str | None) -> dict[str, str]:
        return await self.records.fetch(job_id or "")

    def metric(self, name: str, **labels: str) -> float | None:
        return self.fate.metrics.registry.get_sample_value(name, labels)


def fate_of(redis: Redis, keys: Keys, replicas: int = 0) -> EntryFate:
    records = Records(redis, keys, retention_seconds=600)
    replication = Replication(redis, replicas, timeout_ms=10)
    return EntryFate(Queue(redis, keys, "w"), records, replication, keys, Metrics())


@pytest.fixture
async def jobs(settings: Settings, redis: Redis) -> Jobs:
    keys = Keys(settings.prefix)
    fate = fate_of(redis, keys)
    await fate.queue.ensure_group()
    return Jobs(redis, keys, Client.from_settings(settings, redis), fate)


def attempt_of(entry: Entry, number: int = 1) -> Attempt:
    job_id = entry.job_id or ""
    return Attempt(job_id, number, "{}", "default", JobStream(job_id, number))


def held_by(entry: Entry, *, lost: bool = False) -> HeldEntry:
    """A held entry as settle sees it (settle does not touch its task)."""
    task = asyncio.create_task(asyncio.sleep(0))
    return HeldEntry(entry, task, claimed=True, lost=lost, settling=True)


# -- attempts that did not start ----------------------------------------------------------


async def test_skip_leaves_a_superseded_entry_to_its_newer_delivery(jobs: Jobs) -> None:
    entry = await jobs.entry()
    assert (await jobs.start(entry, delivery=2)).state == "started"
    late = await jobs.start(entry, delivery=1)  # a delivery older than the one running
    assert late.state == "superseded"
    await jobs.fate.skip(entry, late)
    assert await jobs.end_of(entry) == "left"
    assert (await jobs.record(entry.job_id))["status"] == "running"


async def test_skip_acks_the_entry_of_a_job_without_a_record(jobs: Jobs) -> None:
    entry = await jobs.entry(job_id=uuid.uuid4().hex)
    started = await jobs.start(entry)
    assert started.state == "missing"
    await jobs.fate.skip(entry, started)
    assert await jobs.end_of(entry) == "acked"
    assert jobs.metric("chatstream_jobs_missing_total") == 1


async def test_skip_acks_a_duplicate_entry_of_a_job_running_under_another(jobs: Jobs) -> None:
    running = await jobs.entry()
    assert (await jobs.start(running)).state == "started"
    duplicate = await jobs.entry(job_id=running.job_id)
    started = await jobs.start(duplicate)
    assert started.state == "busy"
    await jobs.fate.skip(duplicate, started)
    assert await jobs.end_of(duplicate) == "acked"
    assert await jobs.end_of(running) == "left"
    record = await jobs.record(running.job_id)
    assert (record["status"], record["entry"]) == ("running", running.ref)


async def test_skip_dead_letters_and_acks_an_exhausted_job(jobs: Jobs) -> None:
    entry = await jobs.entry()
    assert (await jobs.start(entry, delivery=1, max_attempts=1)).state == "started"
    started = await jobs.start(entry, delivery=2, max_attempts=1)  # taken over: a 2nd attempt
    assert (started.state, started.dead_pending) == ("exhausted", True)
    await jobs.fate.skip(entry, started)
    assert await jobs.end_of(entry) == "acked"
    [dead] = await jobs.queue.dead_letters()
    assert (dead.job_id, dead.reason) == (
        entry.job_id,
        {"code": "attempts_exhausted", "attempts": 1},
    )
    record = await jobs.record(entry.job_id)
    assert (record["status"], record.get("dead_letter"), "dead_pending" in record) == (
        "failed",
        dead.entry_id,
        False,
    )
    assert jobs.metric("chatstream_jobs_total", status="failed") == 1


@pytest.mark.parametrize(("status", "state"), [("cancelled", "terminal"), ("bogus", "invalid")])
async def test_skip_acks_the_entry_of_a_job_that_ended(jobs: Jobs, status: str, state: str) -> None:
    """A job that is over, or that the start script failed as malformed."""
    entry = await jobs.entry()
    await jobs.redis.hset(jobs.keys.job(entry.job_id or ""), "status", status)
    started = await jobs.start(entry)
    assert started.state == state
    await jobs.fate.skip(entry, started)
    assert await jobs.end_of(entry) == "acked"
    assert await jobs.queue.dead_letters() == []


# -- attempts that ran --------------------------------------------------------------------


@pytest.mark.parametrize(("replicated", "end"), [(True, "acked"), (False, "left")])
async def test_a_finished_attempt_acks_its_entry_once_replicated(
    jobs: Jobs, replicated: bool, end: str
) -> None:
    entry = await jobs.entry()
    await jobs.start(entry)
    job = attempt_of(entry)
    job.replicated = replicated
    await jobs.fate.settle(held_by(entry), job, Outcome.FINISHED)
    assert await jobs.end_of(entry) == end


@pytest.mark.parametrize(
    ("lost", "status", "end"), [(False, "queued", "requeued"), (True, "running", "left")]
)
async def test_a_released_attempt_goes_back_to_the_queue_unless_its_lease_was_lost(
    jobs: Jobs, lost: bool, status: str, end: str
) -> None:
    """Released (shutdown): the record is queued again and a fresh entry replaces ours. With
    the lease lost, the job is another worker's now: neither is touched."""
    entry = await jobs.entry()
    await jobs.start(entry)
    await jobs.fate.settle(held_by(entry, lost=lost), attempt_of(entry), Outcome.RELEASED)
    assert await jobs.end_of(entry) == end
    record = await jobs.record(entry.job_id)
    assert (record["status"], record.get("releases")) == (status, "1" if not lost else None)


@pytest.mark.parametrize(
    ("record", "attempt", "end"),
    [
        ({"attempt": "2"}, 1, "left"),  # a newer attempt runs the job
        ({"status": "succeeded"}, 1, "acked"),  # ended (a retried terminal write, say)
        ({"status": "failed", "dead_pending": "1"}, 1, "acked"),  # and is to be dead-lettered
        ({}, 2, "requeued"),  # behind this attempt: Redis lost its writes
    ],
    ids=["newer-attempt", "ended", "exhausted", "record-behind"],
)
async def test_a_stale_attempt_leaves_acks_or_requeues_by_the_record(
    jobs: Jobs, record: dict[Any, Any], attempt: int, end: str
) -> None:
    entry = await jobs.entry()
    await jobs.start(entry)
    if record:
        await jobs.redis.hset(jobs.keys.job(entry.job_id or ""), mapping=record)
    await jobs.fate.settle(held_by(entry), attempt_of(entry, attempt), Outcome.STALE)
    assert await jobs.end_of(entry) == end
    dead = [letter.job_id for letter in await jobs.queue.dead_letters()]
    assert dead == ([entry.job_id] if "dead_pending" in record else [])
    if end == "requeued":
        after = await jobs.record(entry.job_id)
        assert (after["status"], after["attempt"]) == ("queued", "2")  # still fenced at 2


async def test_a_stale_attempt_of_a_job_whose_record_is_gone_acks_its_entry(jobs: Jobs) -> None:
    entry = await jobs.entry()
    await jobs.start(entry)
    await jobs.redis.delete(jobs.keys.job(entry.job_id or ""))
    await jobs.fate.settle(held_by(entry), attempt_of(entry), Outcome.STALE)
    assert await jobs.end_of(entry) == "acked"
    assert jobs.metric("chatstream_jobs_missing_total") == 1


async def test_an_ended_job_keeps_its_entry_until_replicas_have_its_end(jobs: Jobs) -> None:
    """With replicas to wait for and none to answer (this redis-server has none), the entry
    stays, to be checked again after the lease. Acked once replicated: tests/system."""
    entry = await jobs.entry()
    await jobs.redis.hset(jobs.keys.job(entry.job_id or ""), "status", "succeeded")
    fate = fate_of(jobs.redis, jobs.keys, replicas=1)
    await fate.ack_ended(entry, entry.job_id or "")
    assert await jobs.end_of(entry) == "left"
    assert "replica_check" in await jobs.record(entry.job_id)  # the write WAIT waited for


# -- entries held but not run -------------------------------------------------------------


async def test_entries_held_but_not_run_are_handed_back_unless_idle_too_long(
    jobs: Jobs,
) -> None:
    """At shutdown: a started job is released and requeued, one never started requeued, an
    entry whose stream entry is gone acked; one idle too long may be being taken over right
    now and is left to that."""
    started, unstarted, old = await jobs.entry(), await jobs.entry(), await jobs.entry()
    for entry in (started, old):
        await jobs.start(entry)
    vanished = await jobs.entry(job_id="vanished")
    await jobs.redis.xdel(jobs.keys.queue, vanished.entry_id)
    await jobs.redis.xclaim(jobs.keys.queue, GROUP, "w", 0, [old.entry_id], idle=60_000)
    await jobs.fate.hand_back_unstarted(max_idle_ms=30_000)
    ends = [await jobs.end_of(entry) for entry in (started, unstarted, vanished, old)]
    assert ends == ["requeued", "requeued", "acked", "left"]
    statuses = [(await jobs.record(entry.job_id))["status"] for entry in (started, unstarted, old)]
    assert statuses == ["queued", "queued", "running"]
