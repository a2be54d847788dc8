"""WakeCoalescer: the loop sleeps out the tick only once it has gone idle, and only while
jobs run (a fake clock: the loop's own passes take no time, work takes what it says);
and a real worker turns it on for a job and off after it."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.harness import Harness, chat
from worker.service.ticks import WakeCoalescer

TICK = 0.004


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_an_idle_loop_sleeps_one_tick_per_pass_while_jobs_run() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(TICK, lambda: True, clock, clock.sleep)
    coalescer.resume()
    await passes(10)
    coalescer.stop()
    assert len(clock.slept) >= 5
    assert clock.slept == pytest.approx([TICK] * len(clock.slept))


async def test_no_sleep_while_callbacks_keep_the_loop_busy() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(TICK, lambda: True, clock, clock.sleep)
    coalescer.resume()
    for _ in range(20):  # a chain of wake-ups, each doing 1 ms of work
        clock.now += 0.001
        await asyncio.sleep(0)
    busy_sleeps = len(clock.slept)
    await passes(5)  # the chain ended: the loop is idle
    coalescer.stop()
    assert busy_sleeps == 0
    assert clock.slept, "an idle loop sleeps"
    # the first sleep after 20 ms of work: the tick began with the work, none of it is left
    assert clock.slept[0] == pytest.approx(TICK)


async def test_it_stops_when_no_job_runs_and_resumes_with_the_next() -> None:
    clock = FakeClock()
    jobs = [1]
    coalescer = WakeCoalescer(TICK, lambda: bool(jobs), clock, clock.sleep)
    coalescer.resume()
    await passes(3)
    assert coalescer.running
    jobs.clear()
    await passes(3)
    assert not coalescer.running
    slept = len(clock.slept)
    await passes(3)
    assert len(clock.slept) == slept  # the loop blocks in its poll again: no sleeps
    jobs.append(2)
    coalescer.resume()
    coalescer.resume()  # idempotent
    await passes(3)
    assert coalescer.running and len(clock.slept) > slept
    coalescer.stop()
    assert not coalescer.running


async def test_a_zero_tick_never_runs() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(0.0, lambda: True, clock, clock.sleep)
    coalescer.resume()
    await passes(5)
    assert not coalescer.running and clock.slept == []


async def test_a_worker_paces_its_loop_only_while_it_runs_jobs(harness: Harness) -> None:
    ticks = harness.worker.ticks
    assert not ticks.running and ticks.sleeps == 0  # started, no job yet: no pacing
    record = await harness.run(chat("hi", tokens=20))
    assert record.status == "succeeded"
    await passes(2)
    assert ticks.sleeps > 0  # the job waited for its upstream and Redis in ticks
    assert not ticks.running  # no job runs: the loop blocks in its poll again
