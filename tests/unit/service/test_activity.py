"""What a worker keeps in Redis for the dashboard: its report beside each heartbeat, and the
per-minute activity counts of the jobs it ended (added by its upkeep, never per token)."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from tests.helpers.harness import Harness, chat, custom_harness
from worker import package_version
from worker.errors import RetryableUpstreamError
from worker.store.activity import ActivityLog, merge, minute_of, ttft_histogram


@pytest.fixture
def h(harness: Harness) -> Harness:
    return harness


async def test_a_worker_counts_the_jobs_it_ended_per_minute(h: Harness) -> None:
    began = time.time()
    ok = [await h.client.enqueue(chat(), tenant="acme") for _ in range(2)]
    bad = await h.client.enqueue(chat(fault="http_400"), tenant="zeta", priority="low")
    await h.worker.run_burst()
    assert h.worker.metrics.activity.pending  # counted in memory, not written yet
    await h.worker.upkeep.flush_activity()
    assert not h.worker.metrics.activity.pending
    minutes = range(minute_of(began), minute_of(time.time()) + 1)
    counts = merge((await ActivityLog(h.redis, h.worker.keys).read(minutes)).values())
    records = [await h.client.get(job_id) for job_id in [*ok, bad]]
    tokens = sum((r.usage or {}).get("completion_tokens", 0) for r in records)
    assert counts["n:succeeded"] == 2 and counts["n:failed"] == 1 and tokens > 0
    assert counts["tok"] == counts["u:default:tok"] == counts["t:acme:tok"] == tokens
    assert counts["t:acme:n"] == 2 and counts["t:zeta:f"] == 1 and "t:acme:f" not in counts
    assert counts[f"f:{(records[2].error or {})['code']}"] == 1
    assert sum(ttft_histogram(counts)) == 2  # the failed job had no first token


async def test_a_worker_reports_itself_beside_its_heartbeat(h: Harness, redis: Redis) -> None:
    worker = h.worker
    await worker.upkeep.beat()
    info = json.loads(await redis.hget(worker.keys.workers_info, worker.name) or "{}")
    assert info["version"] == package_version() and info["slots"] == h.settings.concurrency
    assert info["busy"] == 0 and info["waiting"] == 0 and info["down"] == {}
    assert abs(info["started"] - worker.started_at) < 0.01
    async with custom_harness(h) as other:
        await other.worker.upkeep.beat()
        assert await redis.hexists(worker.keys.workers_info, other.worker.name)
    assert not await redis.hexists(worker.keys.workers_info, other.worker.name)  # left


async def test_a_down_upstreams_error_is_reported_without_its_secrets(
    h: Harness, redis: Redis, unused_tcp_port: int
) -> None:
    """The gate's last error is the worker's own text; should it ever hold a configured
    secret (a proxy echoing the key, say), the report masks it as the logs do."""
    secret = "sk-never-on-the-page-4711"
    closed = f"http://127.0.0.1:{unused_tcp_port}/v1"
    async with custom_harness(
        h, upstream_url=closed, upstream_api_key=SecretStr(secret), retry_attempts=1
    ) as down:
        await down.client.enqueue(chat())
        await down.worker.run_burst()
        gate = down.worker.upstream.gates["default"]
        assert gate.down and "connection refused" in gate.last_error
        said = f"{gate.last_failure} (the proxy said: bad key {secret})"
        gate.last_failure = RetryableUpstreamError(said)
        await down.worker.upkeep.beat()
        raw = await redis.hget(down.worker.keys.workers_info, down.worker.name) or ""
    report = json.loads(raw)["down"]["default"]
    assert "connection refused" in report["error"] and report["for"] >= 0
    assert secret not in raw and "bad key ***" in report["error"]
