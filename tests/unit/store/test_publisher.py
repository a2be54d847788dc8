"""The publisher's per-job order when Redis refuses some commands of a pipeline.

Real Redis; chosen writes are replaced by a command Redis answers with an OOM error (so the
write does not run, as at maxmemory). The publisher is stepped one round trip at a time.
``test_redis_faults.py`` drives the same through real ``maxmemory`` refusals.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from schemas.events import EventType
from tests.helpers.checks import merge_deltas, stream_entries
from tests.helpers.harness import chat
from worker.client import Client
from worker.protocol.accumulator import Delta
from worker.settings import Settings
from worker.store.batch import Command
from worker.store.keys import Keys
from worker.store.publisher import JobStream, Publisher, Terminal
from worker.store.records import Records

REFUSED = (
    "EVAL",
    "return redis.error_reply('OOM command not allowed when used memory > maxmemory')",
    0,
)


class Refusing(Records):
    """Records whose chosen writes Redis refuses: ``refuse[(job, seq)]`` times for a delta,
    ``refuse[(job, 0)]`` for the terminal write."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        super().__init__(redis, keys, 3600)
        self.refuse: Counter[tuple[str, int]] = Counter()

    def delta_command(self, job_id: str, attempt: int, seq: int, data: str) -> Command:
        if self._refused((job_id, seq)):
            return REFUSED
        return super().delta_command(job_id, attempt, seq, data)

    def finish_command(self, job_id: str, attempt: int, last_seq: int, args: list[Any]) -> Command:
        if self._refused((job_id, 0)):
            return REFUSED
        return super().finish_command(job_id, attempt, last_seq, args)

    def _refused(self, key: tuple[str, int]) -> bool:
        if self.refuse[key] <= 0:
            return False
        self.refuse[key] -= 1
        return True


@pytest.fixture
async def setup(
    settings: Settings, redis: Redis
) -> AsyncIterator[tuple[Refusing, Publisher, Client]]:
    keys = Keys(settings.prefix)
    records = Refusing(redis, keys)
    await records.load_scripts()
    publisher = Publisher(redis, records)
    yield records, publisher, Client.from_settings(settings, redis)
    await publisher.stop()  # closes its sender's connection


async def started(records: Records, client: Client) -> tuple[str, int]:
    job_id = await client.enqueue(chat("p"))
    start = await records.start(job_id, "w", 3, "1-1", delivery=1)
    return job_id, start.attempt


async def round_trip(publisher: Publisher) -> None:
    """One round trip of the flusher: the jobs due, written, their answers settled."""
    await publisher._write(await publisher._next_batch())


def done(content: str) -> Terminal:
    fields = {"status": "succeeded", "content": content, "finished_at": f"{time.time():.6f}"}
    return Terminal("done", {"finish_reason": "stop", "usage": None}, fields)


async def test_a_delta_after_a_refused_one_waits_for_it(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    """Entry 1 refused twice; entry 2 reaches Redis meanwhile but must not land before it.
    (Before, it landed, and the retried entry 1 was then dropped: a hole.)"""
    records, publisher, client = setup
    job_id, attempt = await started(records, client)
    stream = publisher.open(job_id, attempt)
    records.refuse[(job_id, 1)] = 2
    publisher.publish(stream, Delta(role="assistant", content="a"))
    await round_trip(publisher)  # [1: refused]
    publisher.publish(stream, Delta(content="b"))
    await round_trip(publisher)  # [1: refused, 2: not yet]
    assert [seq for seq, _ in stream.unconfirmed] == [1, 2]
    assert await redis.xlen(records.keys.events(job_id)) == 0
    await round_trip(publisher)  # [1, 2] land, in order
    finishing = asyncio.create_task(publisher.finish(stream, done("ab")))
    await asyncio.sleep(0)
    await round_trip(publisher)
    assert await finishing is True
    events = await stream_entries(redis, records.keys, job_id)
    assert [e.type for e in events] == [EventType.DELTA, EventType.DELTA, EventType.DONE]
    assert merge_deltas(events).content == "ab"


async def test_the_terminal_write_waits_for_a_refused_delta(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    records, publisher, client = setup
    job_id, attempt = await started(records, client)
    stream = publisher.open(job_id, attempt)
    records.refuse[(job_id, 1)] = 1
    publisher.publish(stream, Delta(role="assistant", content="last words"))
    finishing = asyncio.create_task(publisher.finish(stream, done("last words")))
    await asyncio.sleep(0)
    await round_trip(publisher)  # [1: refused, terminal: not yet]
    assert not finishing.done()
    assert (await records.fetch(job_id))["status"] == "running"
    await round_trip(publisher)
    assert await finishing is True
    events = await stream_entries(redis, records.keys, job_id)
    assert [e.type for e in events] == [EventType.DELTA, EventType.DONE]
    assert merge_deltas(events).content == "last words"


async def test_a_refused_job_does_not_hold_back_the_others(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    records, publisher, client = setup
    (stuck_id, stuck_attempt), (free_id, free_attempt) = [
        await started(records, client) for _ in range(2)
    ]
    stuck, free = publisher.open(stuck_id, stuck_attempt), publisher.open(free_id, free_attempt)
    records.refuse[(stuck_id, 1)] = 1000
    publisher.publish(stuck, Delta(role="assistant", content="x"))
    publisher.publish(free, Delta(role="assistant", content="y"))
    publisher.start()
    try:
        assert await asyncio.wait_for(publisher.finish(free, done("y")), 2) is True
        assert stuck.refusals >= 1 and stuck.unconfirmed == [(1, stuck.unconfirmed[0][1])]
        records.refuse.clear()  # Redis accepts writes again: the stuck job's entry lands
        assert await asyncio.wait_for(publisher.finish(stuck, done("x")), 5) is True
    finally:
        await publisher.stop()
    assert merge_deltas(await stream_entries(redis, records.keys, stuck_id)).content == "x"


async def test_scripts_missing_after_a_restart_are_loaded_again(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    records, publisher, client = setup
    job_id, attempt = await started(records, client)
    stream = publisher.open(job_id, attempt)
    records.delta_script.sha = "0" * 40  # as if Redis had lost its scripts: NOSCRIPT
    publisher.publish(stream, Delta(role="assistant", content="again"))
    await round_trip(publisher)
    assert stream.refusals == 1 and records.delta_script.sha != "0" * 40
    await round_trip(publisher)
    assert merge_deltas(await stream_entries(redis, records.keys, job_id)).content == "again"


async def test_a_superseded_attempt_stops_publishing(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    records, publisher, client = setup
    job_id, attempt = await started(records, client)
    stream: JobStream = publisher.open(job_id, attempt)
    records.refuse[(job_id, 1)] = 1
    publisher.publish(stream, Delta(role="assistant", content="old"))
    await round_trip(publisher)  # refused
    await records.start(job_id, "w2", 3, "1-1", delivery=2)  # taken over meanwhile
    await round_trip(publisher)
    assert stream.stale and stream.unconfirmed == []
    assert await publisher.finish(stream, done("old")) is False
    events = await stream_entries(redis, records.keys, job_id)
    assert [e.type for e in events] == [EventType.RESET]


class Recording:
    """A sender that records when each round trip began and accepts every write."""

    def __init__(self) -> None:
        self.began: list[float] = []
        self.sizes: list[int] = []
        self.expedited: list[tuple[bool, int]] = []  # (on, round trips begun by then)

    async def send(self, commands: list[Command]) -> list[Any]:
        self.began.append(asyncio.get_running_loop().time())
        self.sizes.append(len(commands))
        await asyncio.sleep(0)
        return [1] * len(commands)  # WRITTEN

    async def aclose(self) -> None:
        pass

    def expedite(self, on: bool) -> None:
        self.expedited.append((on, len(self.began)))


async def test_under_load_round_trips_are_paced_and_carry_many_jobs(
    settings: Settings, redis: Redis
) -> None:
    records = Records(redis, Keys(settings.prefix), 3600)
    sender = Recording()
    publisher = Publisher(redis, records, sender=sender, round_trip_every=0.01)
    streams = [publisher.open(f"job-{i}", 1) for i in range(20)]
    publisher.start()
    try:
        for _ in range(30):  # 20 jobs, a delta each every 2 ms
            for stream in streams:
                publisher.publish(stream, Delta(content="x"))
            await asyncio.sleep(0.002)
    finally:
        await publisher.stop()
    gaps = [b - a for a, b in zip(sender.began, sender.began[1:], strict=False)]
    assert gaps and min(gaps) >= 0.01 * 0.99  # never more often than round_trip_every
    assert sum(sender.sizes) < 30 * len(streams) / 2  # a job's deltas coalesced per entry


async def test_a_delta_after_a_quiet_spell_goes_out_without_waiting(
    settings: Settings, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = Records(redis, Keys(settings.prefix), 3600)
    sender = Recording()
    publisher = Publisher(redis, records, sender=sender, round_trip_every=3600.0)
    publisher._not_before = asyncio.get_running_loop().time() - 1  # the last one long ago
    stream = publisher.open("job", 1)
    publisher.publish(stream, Delta(content="x"))
    batch = await asyncio.wait_for(publisher._next_batch(), 1)  # no hour-long pause
    assert batch == [stream]


class SlowRecording(Recording):
    """Each round trip takes 20 ms (its reply is what a sleeping loop would wait for)."""

    async def send(self, commands: list[Command]) -> list[Any]:
        replies = await super().send(commands)
        await asyncio.sleep(0.02)
        return replies


async def test_a_reply_is_expedited_when_something_waits_for_it(
    settings: Settings, redis: Redis
) -> None:
    """A round trip's reply ends the wake-up tick's sleep only while entries handed over
    after it was sent wait for the next one, or when it carries a job's end."""
    records = Records(redis, Keys(settings.prefix), 3600)
    sender = SlowRecording()
    publisher = Publisher(redis, records, sender=sender, round_trip_every=0.0)
    stream = publisher.open("job", 1)
    publisher.start()
    try:
        publisher.publish(stream, Delta(content="a"))
        await asyncio.sleep(0.05)  # alone: nothing waits for its reply
        assert (len(sender.began), sender.expedited) == (1, [])
        publisher.publish(stream, Delta(content="b"))
        await asyncio.sleep(0.005)  # in flight now
        publisher.publish(stream, Delta(content="c"))  # waits for that reply
        await asyncio.sleep(0.06)
        assert sender.expedited == [(True, 2), (False, 2)]
        assert await asyncio.wait_for(publisher.finish(stream, done("abc")), 1)
    finally:
        await publisher.stop()
    assert sender.expedited[2:] == [(True, 3), (False, 4)]  # the round trip with the end


async def test_flush_returns_once_the_deltas_handed_over_have_landed(
    setup: tuple[Refusing, Publisher, Client], redis: Redis
) -> None:
    records, publisher, client = setup
    job_id, attempt = await started(records, client)
    stream = publisher.open(job_id, attempt)
    records.refuse[(job_id, 1)] = 2  # lands on the third round trip
    publisher.publish(stream, Delta(role="assistant", content="before the reset"))
    publisher.start()
    await asyncio.wait_for(publisher.flush(stream), 5)
    assert stream.pending is None and stream.unconfirmed == []
    content = merge_deltas(await stream_entries(redis, records.keys, job_id)).content
    assert content == "before the reset"
