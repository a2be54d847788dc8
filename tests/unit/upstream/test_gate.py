"""The upstream gate: while an upstream is down, one probe at a time on a capped backoff
(or the upstream's Retry-After), everyone else waiting without a slot until it is back.

The gate's clock is replaced (``InstantGateWaits``): a timed wait returns at once and moves
the clock on by its length, so backoffs are checked without being waited.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest

from tests.helpers.fakes import InstantGateWaits
from worker.errors import RetryableUpstreamError, TerminalUpstreamError
from worker.upstream.gate import IdleSlot, UpstreamGate, keep_slot
from worker.upstream.verdict import Grain


@pytest.fixture
def clock() -> Iterator[InstantGateWaits]:
    with InstantGateWaits().installed() as installed:
        yield installed


async def take_down(gate: UpstreamGate, retry_after: float | None = None) -> None:
    with pytest.raises(RetryableUpstreamError):
        async with gate.admitted(keep_slot):
            raise RetryableUpstreamError("refused", retry_after=retry_after, unreachable=True)
    assert gate.down


class Upstream:
    """Fails the first ``failures`` tries, then answers; records how many ran at once."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.running = 0
        self.most_at_once_while_down = 0

    async def call(self, gate: UpstreamGate) -> None:
        self.calls += 1
        self.running += 1
        if gate.down:
            self.most_at_once_while_down = max(self.most_at_once_while_down, self.running)
        try:
            await asyncio.sleep(0.005)
            if self.failures > 0:
                self.failures -= 1
                raise RetryableUpstreamError("connection reset", unreachable=True)
        finally:
            self.running -= 1


async def job(gate: UpstreamGate, upstream: Upstream, idle: IdleSlot = keep_slot) -> None:
    while True:
        try:
            async with gate.admitted(idle):
                await upstream.call(gate)
                return
        except RetryableUpstreamError:
            continue


async def test_while_down_one_job_probes_at_a_time_and_all_resume_once_it_is_back(
    clock: InstantGateWaits,
) -> None:
    gate = UpstreamGate("up", 0.5, 20.0)
    await take_down(gate)
    upstream = Upstream(failures=3)
    slots_given_back = 0

    @asynccontextmanager
    async def idle() -> AsyncIterator[None]:
        nonlocal slots_given_back
        slots_given_back += 1
        yield

    await asyncio.gather(*(job(gate, upstream, idle) for _ in range(5)))
    assert not gate.down and gate.waiting == 0
    assert upstream.most_at_once_while_down == 1  # probes, one at a time
    assert upstream.calls == 3 + 1 + 4  # three failed probes, the one that worked, the rest
    assert len(clock.waits) >= 4  # a pause before every probe
    assert all(0 <= wait <= 20.0 for wait in clock.waits)
    assert slots_given_back >= 5  # every job waited without its slot


async def test_retry_after_is_the_pause_up_to_a_minute(clock: InstantGateWaits) -> None:
    gate = UpstreamGate("up", 0.5, 20.0)
    await take_down(gate, retry_after=7)
    await job(gate, Upstream(failures=0))
    assert clock.waits == [7]
    gate = UpstreamGate("up", 0.5, 20.0)
    await take_down(gate, retry_after=3600)
    await job(gate, Upstream(failures=0))
    assert clock.waits[-1] == 60  # max(retry_max_backoff, 60)


async def test_the_pause_grows_and_is_capped(clock: InstantGateWaits) -> None:
    gate = UpstreamGate("up", 0.5, 4.0)
    await take_down(gate)
    await job(gate, Upstream(failures=30))
    assert gate.failures == 0 and len(clock.waits) >= 30
    assert max(clock.waits) <= 4.0
    assert sum(clock.waits[-10:]) > sum(clock.waits[:3])  # later pauses are longer


async def test_a_cancelled_probe_lets_another_job_probe(clock: InstantGateWaits) -> None:
    gate = UpstreamGate("up", 0.5, 20.0)
    await take_down(gate)
    hung = asyncio.Event()

    async def hanging_probe() -> None:
        async with gate.admitted(keep_slot):
            hung.set()
            await asyncio.Event().wait()  # the upstream never answers

    probe = asyncio.create_task(hanging_probe())
    await hung.wait()
    other = asyncio.create_task(job(gate, Upstream(failures=0)))
    await asyncio.sleep(0.01)
    assert not other.done() and gate.waiting == 1  # waits while the probe runs
    probe.cancel()
    await asyncio.wait_for(other, 2)
    assert not gate.down


async def test_any_answer_that_is_not_retryable_means_it_is_up(clock: InstantGateWaits) -> None:
    gate = UpstreamGate("up", 0.5, 20.0)
    await take_down(gate)
    with pytest.raises(TerminalUpstreamError):
        async with gate.admitted(keep_slot):
            raise TerminalUpstreamError("HTTP 400")
    assert not gate.down


async def test_while_up_calls_go_through_without_waiting(clock: InstantGateWaits) -> None:
    gate = UpstreamGate("up", 0.5, 20.0)
    upstream = Upstream(failures=0)
    await asyncio.gather(*(job(gate, upstream) for _ in range(3)))
    assert upstream.calls == 3 and clock.waits == []


# -- the grain: an upstream's gate and a target's ---------------------------------------


async def test_a_status_takes_the_target_down_and_tells_the_upstream_it_is_up(
    clock: InstantGateWaits,
) -> None:
    upstream = UpstreamGate("gw", initial_backoff=1, max_backoff=4)
    target = UpstreamGate("gw", initial_backoff=1, max_backoff=4, model="bad")
    await take_down(upstream)
    with pytest.raises(RetryableUpstreamError):
        async with upstream.admitted(keep_slot), target.admitted(keep_slot, Grain.TARGET):
            raise RetryableUpstreamError("HTTP 503", status=503)
    assert target.down and not upstream.down  # the upstream answered: up; the model: down
    assert target.label == "upstream 'gw' model 'bad'"
    assert target.where() == {"upstream": "gw", "model": "bad"}


async def test_an_unreachable_upstream_says_nothing_of_its_targets(
    clock: InstantGateWaits,
) -> None:
    upstream = UpstreamGate("gw", initial_backoff=1, max_backoff=4)
    target = UpstreamGate("gw", initial_backoff=1, max_backoff=4, model="m")
    with pytest.raises(RetryableUpstreamError):
        async with upstream.admitted(keep_slot), target.admitted(keep_slot, Grain.TARGET):
            raise RetryableUpstreamError("connection refused", unreachable=True)
    assert upstream.down and not target.down
