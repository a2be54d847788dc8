"""Scale-out: several ``chatstream worker`` processes share one queue; each job runs once."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.checks import check_stream
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK, chat
from worker.client import Client
from worker.store.keys import GROUP, Keys
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import expected_reply

JOBS = 200
WORKERS = 3


def job_request(i: int) -> dict[str, Any]:
    """Varied lengths (20..100 tokens), paced so that many streams overlap."""
    return chat(f"job {i}", tokens=20 + (i * 37) % 81, rate=400, key=f"job-{i}")


async def wait_all_terminal(redis: RedisClient, keys: Keys, ids: list[str], timeout: float) -> None:
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
    redis: RedisClient, client: Client, keys: Keys, ids: list[str]
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
async def test_jobs_spread_over_worker_processes_run_exactly_once(fleet: Fleet) -> None:
    redis, keys, client = fleet.redis, fleet.keys, fleet.client
    # 100 slots each: no single worker can hold all the jobs
    workers = await fleet.start(WORKERS, concurrency=100, block_ms=200, shutdown_grace_seconds=5)
    requests = [job_request(i) for i in range(JOBS)]
    ids = [await client.enqueue(r, job_id=f"mp-{i}") for i, r in enumerate(requests)]
    await wait_all_terminal(redis, keys, ids, timeout=60)
    records, streams = await read_all(redis, client, keys, ids)
    output = await fleet.stop(workers, timeout=8)

    assert " ERROR " not in output, output
    for request, record, events in zip(requests, records, streams, strict=True):
        assert record.status == "succeeded", (record.id, record.error)
        assert record.content == expected_reply(request, MOCK), record.id
        assert record.attempt == 1, record.id
        check_stream(events, record)
        assert EventType.RESET not in [e.type for e in events], record.id
    assert fleet.mock.key_requests == Counter({f"job-{i}": 1 for i in range(JOBS)})
    per_worker = Counter(record.worker for record in records)
    assert len(per_worker) > 1, per_worker
    assert sum(per_worker.values()) == JOBS
    assert await redis.xlen(keys.queue) == 0
    pending: Any = await redis.xpending(keys.queue, GROUP)
    assert pending["pending"] == 0
    assert await redis.xlen(keys.dead) == 0
    assert await redis.zcard(keys.workers) == 0  # all left cleanly
