"""Cancellation: queued jobs never start, running jobs close their upstream at once.

``client.cancel`` (and ``chatstream cancel``, tests/system/test_cancel.py) marks the record
and publishes on ``<prefix>:cancel``; the worker running the job cancels its task, which
closes the upstream response, and writes ``cancelled`` with the output so far. A cancel
flag on the record is the fallback when the pub/sub message is lost (polled with the
leases).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.events import EventType
from tests.helpers.harness import (
    Harness,
    assert_cancelled_with_partial_output,
    chat,
    custom_harness,
    start_slow_job,
)
from worker.client import SyncClient
from worker.errors import JobNotFoundError
from worker.store.keys import GROUP
from worker.testing.mock_upstream import expected_reply

CLOSE_WITHIN = 0.25


async def queue_is_empty(h: Harness) -> bool:
    pending = await h.redis.xpending(h.worker.keys.queue, GROUP)
    return int(pending["pending"]) == 0 and await h.redis.xlen(h.worker.keys.queue) == 0


async def test_a_cancelled_queued_job_never_starts(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("never"))
    assert await harness.client.cancel(job_id) == "cancelled"
    await harness.worker.run_burst()
    record = await harness.client.get(job_id)
    assert record.status == "cancelled"
    assert record.started_at is None
    assert record.attempt == 0
    assert sum(harness.mock.requests.values()) == 0
    assert [e.type for e in await harness.events(job_id)] == [EventType.CANCELLED]
    assert await queue_is_empty(harness)


async def test_a_job_cancelled_while_handed_back_never_restarts(harness: Harness) -> None:
    """Cancel requested while running, then the attempt was released (worker shutdown):
    the next worker to pick it up ends it ``cancelled`` instead of running it again."""
    job_id = await harness.client.enqueue(chat("handed back"))
    records = harness.worker.records
    started = await records.start(job_id, "a-worker-shutting-down", 3)
    assert started.state == "started"
    assert await harness.client.cancel(job_id) == "requested"
    assert await records.release(job_id, started.attempt)
    await harness.worker.run_burst()
    record = await harness.client.get(job_id)
    assert record.status == "cancelled"
    assert sum(harness.mock.requests.values()) == 0
    assert [e.type for e in await harness.events(job_id)] == [EventType.CANCELLED]
    assert await queue_is_empty(harness)


async def test_cancel_closes_the_upstream_connection_within_250ms(harness: Harness) -> None:
    job_id, burst = await start_slow_job(harness)
    began = time.monotonic()
    assert await harness.client.cancel(job_id) == "requested"
    async with asyncio.timeout(2):
        await harness.mock.disconnected.wait()
    closed_after = harness.mock.disconnects[-1][1] - began
    assert closed_after < CLOSE_WITHIN, f"upstream closed {closed_after * 1000:.0f} ms after cancel"
    assert await burst == 1
    await assert_cancelled_with_partial_output(harness, job_id)
    assert await queue_is_empty(harness)
    assert harness.mock.open_streams == 0


async def test_the_worker_goes_on_after_a_cancel(harness: Harness) -> None:
    job_id, burst = await start_slow_job(harness)
    await harness.client.cancel(job_id)
    await burst
    request = chat("next", tokens=5)
    record = await harness.run(request)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, harness.mock.config)


async def test_cancel_flag_is_polled_when_the_pubsub_message_is_lost(harness: Harness) -> None:
    # lease 0.6 s: the maintenance loop (leases, cancel flags) runs every 0.2 s
    async with custom_harness(harness, lease_seconds=0.6) as h:
        job_id, burst = await start_slow_job(h)
        # what client.cancel does, minus the PUBLISH: as if the message was lost
        assert await h.client.records.cancel(job_id) == "requested"
        async with asyncio.timeout(2):
            await h.mock.disconnected.wait()
        await burst
        await assert_cancelled_with_partial_output(h, job_id)


async def test_cancel_of_a_finished_job_returns_its_status_unchanged(harness: Harness) -> None:
    record = await harness.run(chat("done"))
    events = await harness.events(record.id)
    assert await harness.client.cancel(record.id) == "succeeded"
    after = await harness.client.get(record.id)
    assert after.status == "succeeded"
    assert after.content == record.content
    assert not after.cancel_requested
    assert await harness.events(record.id) == events


async def test_cancel_of_a_failed_job_returns_failed(harness: Harness) -> None:
    record = await harness.run(chat("bad", fault="http_400"))
    assert await harness.client.cancel(record.id) == "failed"
    assert (await harness.client.get(record.id)).status == "failed"


async def test_cancel_twice_is_harmless(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("twice"))
    assert await harness.client.cancel(job_id) == "cancelled"
    assert await harness.client.cancel(job_id) == "cancelled"
    assert [e.type for e in await harness.events(job_id)] == [EventType.CANCELLED]


async def test_cancel_of_an_unknown_job_raises_job_not_found(harness: Harness) -> None:
    with pytest.raises(JobNotFoundError, match="no job 'nope'"):
        await harness.client.cancel("nope")


async def test_sync_client_cancels_a_queued_job(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("sync"))

    def cancel() -> str:
        with SyncClient(harness.settings) as client:
            return str(client.cancel(job_id))

    assert await asyncio.to_thread(cancel) == "cancelled"
    assert (await harness.client.get(job_id)).status == "cancelled"
