"""Upkeep (worker/service/upkeep.py) on its own: leases, takeovers, stranded entries, cancel
flags and pruning, for a fake Host (what Upkeep needs of a worker) on real Queue, Records
and Liveness objects and the session's redis-server, without a worker or its tasks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.harness import chat
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.service import upkeep as upkeep_module
from worker.service.entries import HeldEntry
from worker.service.metrics import Metrics
from worker.service.pipeline import Attempt
from worker.service.upkeep import Upkeep
from worker.settings import Settings
from worker.store.keys import GROUP, Keys
from worker.store.liveness import Liveness
from worker.store.publisher import JobStream
from worker.store.queue import Entry, Queue
from worker.store.records import Records
from worker.store.redis_client import RedisClient


@dataclass
class FakeHost:
    """The worker ``w`` as Upkeep sees it (the ``Host`` protocol); what it launches is kept
    in ``launched``, and ``client`` queues jobs for it."""

    settings: Settings
    redis: RedisClient
    keys: Keys
    queue: Queue
    records: Records
    liveness: Liveness
    client: Client
    metrics: Metrics = field(default_factory=Metrics)
    running: dict[str, HeldEntry] = field(default_factory=dict)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    serves_metrics: bool = False
    free: int = 64
    launched: list[Entry] = field(default_factory=list)

    def capacity(self) -> int:
        return self.free

    def launch(self, entry: Entry) -> None:
        self.launched.append(entry)

    def report(self) -> dict[str, Any]:
        return {"slots": self.free}


@pytest.fixture
async def host(settings: Settings, redis: Redis) -> AsyncIterator[FakeHost]:
    keys = Keys(settings.prefix)
    fake = FakeHost(
        settings,
        redis,
        keys,
        Queue(redis, keys, "w"),
        Records(redis, keys, settings.retention_seconds),
        Liveness(redis, keys, "w", settings.heartbeat_timeout),
        Client.from_settings(settings, redis),
    )
    await fake.queue.ensure_group()
    await fake.liveness.load()
    yield fake
    await cancel_and_wait([held.task for held in fake.running.values()])


async def hold(host: FakeHost, *, started: bool = False) -> HeldEntry:
    """A job queued and its entry run by ``w``: claimed, its attempt started if asked."""
    job_id = await host.client.enqueue(chat())
    [entry] = await host.queue.read(1, None)
    task = asyncio.create_task(asyncio.sleep(30), name=f"job-{job_id}")
    held = host.running[entry.ref] = HeldEntry(entry, task, claimed=True)
    if started:
        held.job = Attempt(job_id, 1, "{}", "default", JobStream(job_id, 1))
    return held


def job_of(held: HeldEntry) -> Attempt:
    assert held.job is not None
    return held.job


async def claim(host: FakeHost, consumer: str, *entries: Entry, idle_ms: int = 0) -> None:
    ids: list[Any] = [entry.entry_id for entry in entries]
    await host.redis.xclaim(host.keys.queue, GROUP, consumer, 0, ids, idle=idle_ms)


async def owners(host: FakeHost) -> dict[str, tuple[str, int]]:
    """Every pending entry's consumer and idle time (ms)."""
    rows: Any = await host.redis.xpending_range(host.keys.queue, GROUP, "-", "+", 100)
    return {row["message_id"]: (row["consumer"], row["time_since_delivered"]) for row in rows}


# -- leases -------------------------------------------------------------------------------


async def test_renewal_stops_a_job_whose_lease_was_lost_but_not_one_settling(
    host: FakeHost,
) -> None:
    ours, taken, settling, unclaimed = [await hold(host, started=True) for _ in range(4)]
    settling.settling = True  # its own ack or hand-back is under way
    unclaimed.claimed = False  # not checked as ours yet: its start does that
    await claim(host, "thief", taken.entry, settling.entry)
    await claim(host, "w", ours.entry, unclaimed.entry, idle_ms=60_000)
    await Upkeep(host).renew_leases()
    assert [held.lost for held in (ours, taken, settling, unclaimed)] == [False, True, False, False]
    assert [held.task.cancelling() for held in (ours, taken, settling)] == [0, 1, 0]
    assert job_of(taken).release_requested
    assert not job_of(settling).release_requested
    idle = {entry_id: ms for entry_id, (_, ms) in (await owners(host)).items()}
    assert idle[ours.entry.entry_id] < 60_000 <= idle[unclaimed.entry.entry_id]


@pytest.mark.parametrize("declared_dead", [True, False])
async def test_a_worker_declared_dead_checks_its_leases_at_its_next_heartbeat(
    host: FakeHost, declared_dead: bool
) -> None:
    upkeep, held = Upkeep(host), await hold(host, started=True)
    await upkeep.beat()
    assert not held.lost
    if declared_dead:  # by another worker, after a stall: it took the entry over
        await host.redis.zrem(host.keys.workers, "w")
    await claim(host, "thief", held.entry)
    await upkeep.beat()
    assert held.lost is declared_dead  # else found at the next renewal


# -- taking over ---------------------------------------------------------------------------


async def test_heartbeats_take_over_a_dead_workers_entries_up_to_capacity(
    host: FakeHost,
) -> None:
    dead = Queue(host.redis, host.keys, "dead")
    for n in range(3):
        await dead.add(f"job-{n}")
    assert len(await dead.read(3, None)) == 3
    await host.redis.zadd(host.keys.workers, {"dead": time.time() - 600})
    host.liveness = Liveness(host.redis, host.keys, "w", timeout=0.5)
    host.free = 2
    upkeep = Upkeep(host)
    await upkeep.beat()
    assert (upkeep.dead, host.launched) == ([], [])  # it judges after beating for the timeout
    began = time.monotonic()
    while not host.launched:  # on time: a beat every 0.05 s
        assert time.monotonic() - began < 5, "never judged"
        await asyncio.sleep(0.05)
        await upkeep.beat()
    assert time.monotonic() - began >= 0.5
    assert len(host.launched) == 2
    assert upkeep.dead == ["dead"]  # it holds one more
    host.stopping.set()
    await upkeep.beat()
    assert len(host.launched) == 2  # nothing taken over while stopping
    host.stopping.clear()
    host.free = 5
    await upkeep.beat()
    assert len(host.launched) == 3
    assert upkeep.dead == []
    assert await host.redis.zscore(host.keys.workers, "dead") is None  # forgotten
    assert {consumer for consumer, _ in (await owners(host)).values()} == {"w"}
    assert host.metrics.registry.get_sample_value("chatstream_reclaims_total") == 3


async def test_entries_delivered_to_us_but_never_seen_are_run(host: FakeHost) -> None:
    """Delivered by a read whose reply was lost: idle half a lease, not among the running."""
    seen = await hold(host)
    await host.queue.add("unseen")
    await host.queue.add("just-read")
    unseen, _just_read = await host.queue.read(2, None)
    await claim(host, "w", seen.entry, unseen, idle_ms=60_000)
    upkeep = Upkeep(host)
    host.stopping.set()
    await upkeep.adopt_stranded()
    assert host.launched == []  # not while stopping: shutdown hands entries back
    host.stopping.clear()
    await upkeep.adopt_stranded()
    assert [entry.job_id for entry in host.launched] == ["unseen"]
    assert (await owners(host))[unseen.entry_id][1] < 60_000  # claimed again: renewed


# -- cancellation --------------------------------------------------------------------------


async def test_cancel_flags_cancel_only_started_jobs(host: FakeHost) -> None:
    flagged, unflagged = await hold(host, started=True), await hold(host, started=True)
    unstarted = await hold(host)
    for held in (flagged, unstarted):
        await host.records.cancel(held.entry.job_id or "")
    await Upkeep(host).poll_cancel_flags()
    assert [job_of(held).cancel_requested for held in (flagged, unflagged)] == [True, False]
    assert [held.task.cancelling() for held in (flagged, unflagged, unstarted)] == [1, 0, 0]


async def test_a_cancel_message_cancels_the_started_job_it_names_once(host: FakeHost) -> None:
    started, unstarted = await hold(host, started=True), await hold(host)
    upkeep = Upkeep(host)
    assert not upkeep.cancel_local("unknown")
    assert not upkeep.cancel_local(unstarted.entry.job_id or "")  # its start sees the flag
    assert upkeep.cancel_local(started.entry.job_id or "")
    assert upkeep.cancel_local(started.entry.job_id or "")  # a second message
    assert job_of(started).cancel_requested
    assert [started.task.cancelling(), unstarted.task.cancelling()] == [1, 0]


# -- maintenance ---------------------------------------------------------------------------


async def test_consumers_of_workers_long_gone_are_pruned_now_and_then(
    host: FakeHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every PRUNE_EVERY: consumers idle that long that hold nothing, except our own."""
    monkeypatch.setattr(upkeep_module, "PRUNE_EVERY", 0.05)
    host.settings = host.settings.model_copy(update={"lease_seconds": 0.001})
    await host.queue.add("done")
    [done] = await host.queue.read(1, None)
    assert await host.queue.ack(done)  # our own consumer, idle from now on, holds nothing
    holder = Queue(host.redis, host.keys, "holder")
    await holder.add("held")
    assert len(await holder.read(1, None)) == 1
    await host.redis.xgroup_createconsumer(host.keys.queue, GROUP, "gone")
    await asyncio.sleep(0.06)
    upkeep = Upkeep(host)

    async def consumers() -> set[str]:
        await upkeep.prune_consumers()
        rows: Any = await host.redis.xinfo_consumers(host.keys.queue, GROUP)
        return {row["name"] for row in rows}

    assert await consumers() == {"gone", "holder", "w"}  # its first sweep is not due yet
    await asyncio.sleep(0.06)
    assert await consumers() == {"holder", "w"}


@pytest.mark.parametrize("serves_metrics", [True, False])
async def test_maintenance_reads_the_queue_gauges_only_when_metrics_are_served(
    host: FakeHost, serves_metrics: bool
) -> None:
    host.serves_metrics = serves_metrics
    await hold(host)
    await host.client.enqueue(chat())
    await Upkeep(host).maintain_once()
    counts = host.metrics.queue.counts
    read = None if counts is None else (counts.length, counts.pending)
    assert read == ((2, 1) if serves_metrics else None)
