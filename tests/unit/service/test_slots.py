"""Slots (worker/service/slots.py) on their own: capacity with jobs waiting for a down
upstream, a slot taken and given back, ``without_slot`` giving it up and taking it again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from worker.service.entries import HeldEntry
from worker.service.slots import Slots
from worker.store.queue import Entry


@pytest.fixture
async def held() -> AsyncIterator[Callable[[], HeldEntry]]:
    """Held entries (Slots only reads and sets their flags), sharing one idle task."""
    task = asyncio.create_task(asyncio.sleep(30))
    count = 0

    def make() -> HeldEntry:
        nonlocal count
        count += 1
        return HeldEntry(Entry(f"{count}-0", f"job-{count}", {}), task)

    yield make
    task.cancel()


async def runs_on(task: asyncio.Task[Any]) -> bool:
    """Whether the task is still waiting once everything else that could run has."""
    for _ in range(5):
        await asyncio.sleep(0)
    return not task.done()


async def waiting_for_upstream(
    slots: Slots, entry: HeldEntry
) -> tuple[asyncio.Task[None], asyncio.Event]:
    """A job that took a slot, then waits without it (as its upstream client does while the
    upstream is down) until the event returned is set; returned once it waits."""
    await slots.take(entry)
    inside, back = asyncio.Event(), asyncio.Event()

    async def job() -> None:
        async with slots.without_slot(entry)():
            inside.set()
            await back.wait()

    task = asyncio.create_task(job())
    await asyncio.wait_for(inside.wait(), 1)
    return task, back


@pytest.mark.parametrize(
    ("held_entries", "waiting", "expected"),
    [(0, 0, 4), (3, 0, 1), (4, 0, 0), (4, 2, 2), (2, 2, 4), (5, 3, 1), (6, 2, 0)],
)
def test_capacity_is_the_free_slots_within_concurrency_plus_max_waiting(
    held_entries: int, waiting: int, expected: int
) -> None:
    """Jobs waiting for a down upstream hold no slot; all held entries stay within
    ``concurrency + max_waiting``."""
    slots = Slots(concurrency=4, max_waiting=2)
    slots.waiting = waiting
    assert slots.capacity(held_entries) == expected


async def test_a_reader_waiting_for_capacity_goes_on_once_an_entry_is_freed() -> None:
    slots, held_entries = Slots(concurrency=2, max_waiting=0), 2
    reader = asyncio.create_task(slots.wait_for_capacity(lambda: held_entries))
    assert await runs_on(reader)
    held_entries = 1
    slots.freed()
    assert await asyncio.wait_for(reader, 1) == 1


async def test_a_job_giving_up_its_slot_lets_a_reader_waiting_for_capacity_on(
    held: Callable[[], HeldEntry],
) -> None:
    slots, entry = Slots(concurrency=1, max_waiting=1), held()
    await slots.take(entry)
    reader = asyncio.create_task(slots.wait_for_capacity(lambda: 1))
    assert await runs_on(reader)
    async with slots.without_slot(entry)():
        assert await asyncio.wait_for(reader, 1) == 1


async def test_a_slot_given_back_twice_is_freed_once(held: Callable[[], HeldEntry]) -> None:
    slots, first, second, third = Slots(concurrency=1, max_waiting=0), held(), held(), held()
    await slots.take(first)
    assert first.holds_slot
    taking = asyncio.create_task(slots.take(second))
    assert await runs_on(taking)
    slots.give_back(first)
    slots.give_back(first)
    await asyncio.wait_for(taking, 1)
    assert (first.holds_slot, second.holds_slot) == (False, True)
    blocked = asyncio.create_task(slots.take(third))
    assert await runs_on(blocked)  # the one slot is the second's
    blocked.cancel()


async def test_without_slot_frees_the_slot_while_waiting_and_takes_it_back(
    held: Callable[[], HeldEntry],
) -> None:
    slots, waiter, other = Slots(concurrency=1, max_waiting=1), held(), held()
    job, back = await waiting_for_upstream(slots, waiter)
    assert (waiter.holds_slot, waiter.waiting, slots.waiting) == (False, True, 1)
    await asyncio.wait_for(slots.take(other), 1)  # the slot it gave up
    back.set()
    assert await runs_on(job)  # its turn came: it waits for a slot
    assert (waiter.holds_slot, waiter.waiting, slots.waiting) == (False, False, 0)
    slots.give_back(other)
    await asyncio.wait_for(job, 1)
    assert waiter.holds_slot


@pytest.mark.parametrize("when", ["waiting-for-upstream", "taking-the-slot-back"])
async def test_a_job_cancelled_without_its_slot_takes_none(
    held: Callable[[], HeldEntry], when: str
) -> None:
    slots, waiter, other = Slots(concurrency=1, max_waiting=1), held(), held()
    job, back = await waiting_for_upstream(slots, waiter)
    await slots.take(other)
    if when == "taking-the-slot-back":
        back.set()
        assert await runs_on(job)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(job, 1)
    assert (waiter.holds_slot, waiter.waiting, slots.waiting) == (False, False, 0)
    slots.give_back(other)
    await asyncio.wait_for(slots.take(held()), 1)  # the slot is free: the cancelled job has none
