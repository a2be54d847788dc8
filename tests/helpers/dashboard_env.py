"""A fleet for the dashboard's tests (and its screenshots): a real redis-server, the mock
upstream, an in-process worker with two slots consuming live, and jobs in every state the
dashboard shows: succeeded, failed, a dead letter, running (slow replies) and waiting (in
their tenants' queues, by priority); then the dashboard served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import SecretStr

from schemas.requests import Priority
from tests.helpers.checks import eventually
from tests.helpers.harness import chat
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.dashboard import serve_dashboard
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockConfig, MockUpstream, serve_mock

OPERATOR_KEY = "sk-dashboard-operator-test"
KEY_HEADER = "X-Chatstream-Dashboard-Key"
UPSTREAM_KEY = "sk-upstream-secret-never-shown"
SLOW = {"tokens": 3000, "rate": 20.0}  # a reply of 150 s: running for the whole test
QUICK = {"tokens": 8, "rate": 0.0}


@dataclass
class Scene:
    url: str
    settings: Settings
    redis: RedisClient
    client: Client
    worker: Worker
    mock: MockUpstream
    jobs: dict[str, list[str]] = field(default_factory=dict)  # state -> job ids

    def http(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {KEY_HEADER: key} if key is not None else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)

    async def until(self, job_id: str, *statuses: str, timeout: float = 20) -> None:
        async def reached() -> bool:
            return (await self.client.get(job_id)).status in statuses

        await eventually(reached, timeout)


@asynccontextmanager
async def dashboard_scene(
    settings: Settings, redis: RedisClient, **updates: Any
) -> AsyncIterator[Scene]:
    app = MockUpstream(MockConfig(tokens=8))
    async with serve_mock(app=app) as upstream_url:
        defaults: dict[str, Any] = {
            "upstream_url": upstream_url,
            "upstream_api_key": SecretStr(UPSTREAM_KEY),
            "dashboard_keys": SecretStr(f"ops={OPERATOR_KEY}"),
            "concurrency": 2,
            "max_attempts": 2,
            "upstream_max_concurrent": 4,
            "upstream_requests_per_minute": 600,
        }
        settings = settings.model_copy(update={**defaults, **updates})
        worker = Worker(settings, redis)
        await worker.startup()
        consume = asyncio.create_task(worker.consume())
        client = Client.from_settings(settings, redis)
        try:
            async with serve_dashboard(settings, redis, host="127.0.0.1", port=0) as url:
                scene = Scene(url, settings, redis, client, worker, app)
                await _fill(scene)
                yield scene
        finally:
            worker.stopping.set()
            await cancel_and_wait([consume])
            await worker.shutdown()


async def _fill(scene: Scene) -> None:
    """Jobs in every state: ended ones first, then two running, then five waiting."""
    client = scene.client
    done = [await client.enqueue(chat("hi", **QUICK), tenant="acme") for _ in range(3)]
    failed = [await client.enqueue(chat("no", fault="http_400"), tenant="beta")]
    dead = [await _dead_letter(scene)]
    for job_id in done:
        await scene.until(job_id, "succeeded")
    await scene.until(failed[0], "failed")
    await scene.until(dead[0], "failed")
    running = [await client.enqueue(chat("long", **SLOW), tenant=t) for t in ("acme", "gamma")]
    for job_id in running:
        await scene.until(job_id, "running")
    later: list[tuple[str, Priority]] = [("acme", "high"), ("acme", "normal"), ("acme", "low")]
    later += [("beta", "normal"), ("beta", "normal")]
    waiting = [
        await client.enqueue(chat("later", **SLOW), tenant=tenant, priority=priority)
        for tenant, priority in later
    ]
    await scene.worker.upkeep.flush_activity()
    scene.jobs = {"succeeded": done, "failed": failed, "dead": dead, "running": running,
                  "waiting": waiting}  # fmt: skip


async def _dead_letter(scene: Scene) -> str:
    """A job whose attempts are spent when a worker takes it (as after workers that kept
    dying under it): it fails ``attempts_exhausted`` onto the dead-letter stream."""
    scheduler = scene.client.queue.scheduler
    await scheduler.pause("default")  # held in its tenant's queue while its record is changed
    job_id = await scene.client.enqueue(chat("doomed", **QUICK), tenant="gamma")
    await scene.redis.hset(scene.client.keys.job(job_id), "attempt", scene.settings.max_attempts)
    await scheduler.resume("default")
    return job_id
