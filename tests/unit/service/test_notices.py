"""``waiting`` entries: when they are written, what they say, and that they are fenced."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.checks import eventually, stream_entries
from worker.errors import RetryableUpstreamError
from worker.service import notices
from worker.service.notices import MAX_NOTICES, WaitingNotices
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.records import Records
from worker.upstream import gate as gate_module
from worker.upstream.gate import UpstreamGate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(notices, "monotonic", clock)
    monkeypatch.setattr(gate_module, "monotonic", clock)
    return clock


def down_gate(clock: Clock) -> UpstreamGate:
    gate = UpstreamGate("default", initial_backoff=0.01, max_backoff=0.05)
    gate._failed(RetryableUpstreamError("connection refused by 127.0.0.1:9"), probe=False)
    return gate


def said(job: WaitingNotices, clock: Clock, times: list[float]) -> list[dict[str, Any]]:
    out = []
    for at in times:
        clock.now = at
        if (data := job.describe()) is not None:
            out.append(data)
    return out


class Waits:
    """What the job waits for (``WaitingNotices``' ``outage``): a gate, or nothing."""

    def __init__(self, gate: UpstreamGate | None) -> None:
        self.gate = gate

    def __call__(self) -> UpstreamGate | None:
        return self.gate if self.gate is not None and self.gate.down else None


def notices_for(waits: Waits, attempt: list[int]) -> WaitingNotices:
    records: Records = None  # type: ignore[assignment]  # describe() writes nothing
    return WaitingNotices(records, "j", waits, lambda: attempt[0], lambda: "default")


def test_a_blip_is_not_said_then_once_and_at_growing_pauses(clock: Clock) -> None:
    gate = down_gate(clock)
    job = notices_for(Waits(gate), [1])
    ticks = [1000.0 + step * 0.05 for step in range(4000)]  # a retry tick every 50 ms, 200 s
    entries = said(job, clock, ticks)
    assert [round(e["for_s"]) for e in entries] == [1, 6, 16, 36, 76, 136, 196]
    first = entries[0]
    assert first["reason"] == "upstream_down" and first["upstream"] == "default"
    assert first["detail"] == "connection refused by 127.0.0.1:9"
    assert 0 <= first["retry_in_s"] <= 0.1


def test_at_most_max_notices_per_attempt_and_a_new_attempt_says_it_again(clock: Clock) -> None:
    gate, attempt = down_gate(clock), [1]
    job = notices_for(Waits(gate), attempt)
    hours = [1001.0 + 61 * n for n in range(MAX_NOTICES + 10)]
    assert len(said(job, clock, hours)) == MAX_NOTICES
    attempt[0] = 2
    assert len(said(job, clock, [hours[-1] + 1])) == 1


def test_a_rate_limit_wait_is_said_at_once(clock: Clock) -> None:
    waits = Waits(None)
    job = notices_for(waits, [1])
    [entry] = said(job, clock, [1000.0, 1000.1, 1004.9])
    assert entry["reason"] == "rate_limit" and "requests per minute" in entry["detail"]
    waits.gate = down_gate(clock)  # the reason changed: said at once (after the blip)
    assert [e["reason"] for e in said(job, clock, [1006.0])] == ["upstream_down"]


async def test_the_entry_is_fenced_by_the_running_attempt(
    settings: Settings, redis: Redis, clock: Clock
) -> None:
    keys = Keys(settings.prefix)
    records = Records(redis, keys, 60)
    await redis.hset(keys.job("j"), mapping={"status": "running", "attempt": "2"})
    assert await records.notice("j", 2, "waiting", '{"reason":"rate_limit"}')
    assert not await records.notice("j", 1, "waiting", '{"reason":"rate_limit"}')
    await redis.hset(keys.job("j"), "status", "succeeded")
    assert not await records.notice("j", 2, "waiting", '{"reason":"rate_limit"}')
    [entry] = await stream_entries(redis, keys, "j")
    assert (entry.type.value, entry.attempt) == ("waiting", 2)
    assert 0 < await redis.ttl(keys.events("j")) <= 60
    job = WaitingNotices(records, "j", Waits(None), lambda: 2, lambda: "default")
    await redis.hset(keys.job("j"), "status", "running")
    async with job.around(gate_module.keep_slot)():
        pass
    assert len(await stream_entries(redis, keys, "j")) == 2
    assert (await stream_entries(redis, keys, "j"))[1].parsed_data().model_dump()["reason"] == (
        "rate_limit"
    )


async def test_a_job_that_stays_in_one_wait_is_announced_again(
    settings: Settings, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the probe, a job waits in one ``idle`` for the whole outage: a timer of its own
    writes the later entries, each saying a longer wait; leaving the wait stops it."""
    monkeypatch.setattr(notices, "FIRST_PAUSE", 0.1)
    keys = Keys(settings.prefix)
    await redis.hset(keys.job("j"), mapping={"status": "running", "attempt": "1"})
    gate = UpstreamGate("default", initial_backoff=0.01, max_backoff=0.05)
    gate._failed(RetryableUpstreamError("HTTP 503", retry_after=30.0), probe=False)
    job = WaitingNotices(Records(redis, keys, 60), "j", Waits(gate), lambda: 1)

    async def entries() -> int:
        return len(await stream_entries(redis, keys, "j"))

    async with job.around(gate_module.keep_slot)():
        await eventually(lambda: _at_least(entries(), 3))
    left = await stream_entries(redis, keys, "j")
    waited = [event.data["for_s"] for event in left]
    assert waited == sorted(waited) and waited[-1] > waited[0]
    assert {event.data["detail"] for event in left} == {"HTTP 503"}
    await asyncio.sleep(0.5)  # (the timer would have written two more by now)
    assert len(await stream_entries(redis, keys, "j")) == len(left)


async def _at_least(count: Awaitable[int], wanted: int) -> bool:
    return await count >= wanted
