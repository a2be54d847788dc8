"""In-process workers: the ``harness`` fixture's (a started worker, its client and mock
upstream), variants of it, workers consuming for the length of a block; and what tests
enqueue: chat requests, injected records, jobs spread over shards, a busy queue, a slow job
to cancel."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.queue import Queue
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockConfig, MockUpstream, expected_reply


@dataclass
class Harness:
    """A started in-process worker, a client, and the mock upstream they talk to."""

    settings: Settings
    redis: RedisClient
    mock: MockUpstream
    worker: Worker
    client: Client

    async def run(self, request: dict[str, Any], **kwargs: Any) -> JobRecord:
        """Enqueue one job, run the worker until the queue is empty, return the record."""
        job_id = await self.client.enqueue(request, **kwargs)
        await self.worker.run_burst()
        return await self.client.get(job_id)

    async def events(self, job_id: str) -> list[StreamEvent]:
        return [event async for event in self.client.events(job_id, block_ms=100)]


def chat(text: str = "hello", **mock: Any) -> dict[str, Any]:
    """A chat request for the mock upstream; ``mock`` options steer its behaviour."""
    message = {"role": "user", "content": text}
    request: dict[str, Any] = {"model": "mock-model", "messages": [message]}
    if mock:
        request["mock"] = mock
    return request


MOCK = MockConfig(tokens=12)  # the mock_upstream fixture's server config
MOCK_PROCESS = MockConfig(tokens=64)  # what `chatstream mock-upstream` sends by default


@asynccontextmanager
async def custom_harness(base: Harness, **updates: Any) -> AsyncIterator[Harness]:
    """A second worker on the same Redis and mock, with some settings changed."""
    settings = base.settings.model_copy(update=updates)
    worker = Worker(settings, base.redis)
    await worker.startup()
    try:
        yield Harness(
            settings, base.redis, base.mock, worker, Client.from_settings(settings, base.redis)
        )
    finally:
        await worker.shutdown()


async def inject(h: Harness, fields: dict[str, Any], job_id: str | None = None) -> str:
    """A record and queue entry written directly, bypassing the client's validation."""
    job_id = job_id or uuid.uuid4().hex
    record = {
        "id": job_id,
        "status": "queued",
        "upstream": "default",
        "metadata": "{}",
        "created_at": f"{time.time():.6f}",
        "attempt": "0",
        **fields,
    }
    assert await h.client.records.create(job_id, record) == "created"
    await h.client.records.mark_queued(job_id, await h.client.queue.add(job_id))
    return job_id


def spread(keys: Keys, per_shard: int = 3) -> list[str]:
    """Job ids that ``Client.enqueue`` puts ``per_shard`` on every shard."""
    ids: dict[int, list[str]] = {shard: [] for shard in range(keys.shards)}
    for n in itertools.count():
        job_id = f"spread-{n}"
        if len(found := ids[keys.shard_of(job_id)]) < per_shard:
            found.append(job_id)
        if all(len(found) == per_shard for found in ids.values()):
            return [job_id for found in ids.values() for job_id in found]
    raise AssertionError("unreachable")


@asynccontextmanager
async def consuming(*workers: Worker) -> AsyncIterator[None]:
    """In-process workers consuming until the block exits, then shut down gracefully."""
    for worker in workers:
        await worker.startup()
    tasks = [asyncio.create_task(worker.consume()) for worker in workers]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in workers:
            await worker.shutdown()


async def busy_queue(settings: Settings, redis: RedisClient) -> Keys:
    """What the stats tests read: 5 jobs (2 taken by consumer a, 1 by b, 2 waiting), 2 dead
    letters, 3 heartbeats (2 live, 1 stale)."""
    client = Client.from_settings(settings, redis)
    keys = client.keys
    for i in range(5):
        await client.enqueue(chat(f"s{i}"))
        await asyncio.sleep(0.002)
    queue_a, queue_b = Queue(redis, keys, "a"), Queue(redis, keys, "b")
    await queue_a.ensure_group()
    assert len(await queue_a.read(2, 10)) == 2
    assert len(await queue_b.read(1, 10)) == 1
    await redis.xadd(keys.dead, {"job": "x", "reason": "{}"})
    await redis.xadd(keys.dead, {"job": "y", "reason": "{}"})
    now = time.time()
    await redis.zadd(keys.workers, {"w-live-1": now, "w-live-2": now - 1, "w-gone": now - 600})
    return keys


# -- a slow job, to cancel ---------------------------------------------------------------

SLOW = {"tokens": 400, "rate": 20.0}  # a 20 s reply: only a cancel ends it in time


async def first_delta(h: Harness, job_id: str) -> None:
    async for event in h.client.events(job_id, block_ms=100):
        if event.type is EventType.DELTA:
            return


async def start_slow_job(h: Harness) -> tuple[str, asyncio.Task[int]]:
    """A slow job running in a worker burst, once its first delta was published."""
    job_id = await h.client.enqueue(chat("slow", **SLOW))
    burst = asyncio.create_task(h.worker.run_burst())
    async with asyncio.timeout(5):
        await first_delta(h, job_id)
    await asyncio.sleep(0.2)  # a few more tokens
    return job_id, burst


async def assert_cancelled_with_partial_output(h: Harness, job_id: str) -> list[StreamEvent]:
    record = await h.client.get(job_id)
    events = await h.events(job_id)
    assert record.status == "cancelled"
    assert record.error is None
    assert events[-1].type is EventType.CANCELLED
    assert [e.type for e in events[:-1]] == [EventType.DELTA] * (len(events) - 1)
    published = "".join(e.data.get("content", "") for e in events[:-1])
    full = expected_reply(chat("slow", **SLOW), h.mock.config)
    assert record.content.startswith("tok0 tok1")
    assert record.content == published  # the record keeps exactly what was streamed
    assert len(record.content) < len(full)
    return events
