"""A job waiting for an upstream that is down (default retries, in process): it can be
cancelled, and a shutdown hands it back at once. The outage itself, on real worker
processes, is ``tests/system/test_outage.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

from tests.helpers.checks import eventually, stream_entries
from tests.helpers.harness import chat
from tests.helpers.servers import free_port
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.keys import Keys

# -- a job waiting for a down upstream: cancel, shutdown --------------------------------------


@asynccontextmanager
async def waiting_job(settings: Settings, redis: Redis) -> AsyncIterator[tuple[Worker, str]]:
    """A worker (default retries) whose one job waits for an upstream refusing connections."""
    closed = f"http://127.0.0.1:{free_port()}/v1"
    settings = settings.model_copy(update={"upstream_url": closed, "retry_attempts": None})
    worker = Worker(settings, redis)
    job_id = await Client.from_settings(settings, redis).enqueue(chat("waits"))
    await worker.startup()
    consuming = asyncio.create_task(worker.consume())
    try:
        gate = worker.upstream.gate("default")
        await eventually(lambda: _true(gate.waiting == 1 or gate.next_try_in() > 0))
        yield worker, job_id
    finally:
        consuming.cancel()
        await asyncio.gather(consuming, return_exceptions=True)
        if not worker.stopping.is_set():
            await worker.shutdown()


async def _true(value: bool) -> bool:
    return value


async def test_a_job_waiting_for_its_upstream_can_be_cancelled(
    settings: Settings, redis: Redis
) -> None:
    async with waiting_job(settings, redis) as (worker, job_id):
        client = Client.from_settings(worker.settings, redis)
        assert await client.cancel(job_id) == "requested"
        record = await client.result(job_id, timeout=5)
    assert record.status == "cancelled"
    events = await stream_entries(redis, Keys(settings.prefix), job_id)
    assert [e.type.value for e in events if e.type.value != "waiting"] == ["cancelled"]


async def test_a_job_waiting_for_its_upstream_is_handed_back_at_once_on_shutdown(
    settings: Settings, redis: Redis
) -> None:
    """Not after the grace period: it has no output to finish."""
    settings = settings.model_copy(update={"shutdown_grace_seconds": 20})
    async with waiting_job(settings, redis) as (worker, job_id):
        began = time.monotonic()
        await worker.shutdown()
        took = time.monotonic() - began
    assert took < 5
    record = await Client.from_settings(settings, redis).get(job_id)
    assert (record.status, record.attempt) == ("queued", 1)  # handed back, not counted
    assert await redis.xlen(Keys(settings.prefix).queue) == 1  # a fresh entry for it
