"""Scale-out: several ``chatstream worker`` processes share one queue; each job runs once."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.checks import check_stream
from tests.helpers.harness import chat
from tests.helpers.processes import clean_env, spawn_worker, stop_worker
from tests.helpers.servers import RedisServer
from worker.client import Client
from worker.store.keys import GROUP, Keys
from worker.testing.mock_upstream import MockConfig, MockUpstream, expected_reply, serve_mock

JOBS = 200
WORKERS = 3
MOCK = MockConfig(tokens=16)


def job_request(i: int) -> dict[str, Any]:
    """Varied lengths (20..100 tokens), paced so that many streams overlap."""
    return chat(f"job {i}", tokens=20 + (i * 37) % 81, rate=400, key=f"job-{i}")


async def wait_all_terminal(redis: Redis, keys: Keys, ids: list[str], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while True:
            pipe = redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hget(keys.job(job_id), "status")
            statuses = await pipe.execute()
            if all(s in ("succeeded", "failed", "cancelled") for s in statuses):
                return
            await asyncio.sleep(0.1)


async def read_all(
    redis: Redis, client: Client, keys: Keys, ids: list[str]
) -> tuple[list[JobRecord], list[list[StreamEvent]]]:
    records = [await client.get(job_id) for job_id in ids]
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.xrange(keys.events(job_id))
    streams = [
        [StreamEvent.from_entry(str(eid), dict(fields)) for eid, fields in rows]
        for rows in await pipe.execute()
    ]
    return records, streams


@pytest.mark.slow
async def test_jobs_spread_over_worker_processes_run_exactly_once(
    redis_server: RedisServer | None, redis: Redis, prefix: str, tmp_path: Path
) -> None:
    if redis_server is None:
        pytest.skip("worker processes need a real redis-server")
    keys = Keys(prefix)
    client = Client(redis, prefix=prefix)
    mock = MockUpstream(MOCK)
    processes: list[subprocess.Popen[bytes]] = []
    logs = [tmp_path / f"worker{n}.log" for n in range(WORKERS)]
    async with serve_mock(app=mock) as url:
        env = {
            **clean_env(),
            "CHATSTREAM_REDIS_URL": redis_server.url,
            "CHATSTREAM_PREFIX": prefix,
            "CHATSTREAM_UPSTREAM_URL": url,
            "CHATSTREAM_CONCURRENCY": "100",  # no single worker can hold all the jobs
            "CHATSTREAM_BLOCK_MS": "200",
            "CHATSTREAM_SHUTDOWN_GRACE_SECONDS": "5",
        }
        try:
            for log in logs:
                with log.open("wb") as out:
                    processes.append(spawn_worker(env, tmp_path, out))
            async with asyncio.timeout(20):
                while await redis.zcard(keys.workers) < WORKERS:
                    assert all(p.poll() is None for p in processes), "a worker exited"
                    await asyncio.sleep(0.05)

            requests = [job_request(i) for i in range(JOBS)]
            ids = [await client.enqueue(r, job_id=f"mp-{i}") for i, r in enumerate(requests)]
            await wait_all_terminal(redis, keys, ids, timeout=60)
            records, streams = await read_all(redis, client, keys, ids)

            codes = await asyncio.gather(*(stop_worker(p, timeout=8) for p in processes))
            assert codes == [0] * WORKERS
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    output = "\n".join(log.read_text() for log in logs)
    assert "Traceback" not in output, output
    assert " ERROR " not in output, output
    for request, record, events in zip(requests, records, streams, strict=True):
        assert record.status == "succeeded", (record.id, record.error)
        assert record.content == expected_reply(request, MOCK), record.id
        assert record.attempt == 1, record.id
        check_stream(events, record)
        assert EventType.RESET not in [e.type for e in events], record.id
    assert mock.key_requests == Counter({f"job-{i}": 1 for i in range(JOBS)})
    per_worker = Counter(record.worker for record in records)
    assert len(per_worker) > 1, per_worker
    assert sum(per_worker.values()) == JOBS
    assert await redis.xlen(keys.queue) == 0
    pending: Any = await redis.xpending(keys.queue, GROUP)
    assert pending["pending"] == 0
    assert await redis.xlen(keys.dead) == 0
    assert await redis.zcard(keys.workers) == 0  # all left cleanly
