"""An in-process worker with its client and mock upstream (the ``harness`` fixture), its
variants, and the jobs the tests enqueue."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from schemas.events import StreamEvent
from schemas.jobs import JobRecord
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockConfig, MockUpstream


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
MOCK_PROCESS = MockConfig(tokens=64)  # `chatstream mock-upstream`'s default server config


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
