"""Redis faults on real processes: writes refused at ``maxmemory``. ``chatstream worker``
subprocesses against a redis-server of the test's own.

What must hold (docs/reliability.md): per job, the events stream is gapless whatever subset
of a pipeline Redis refuses (a delta entry lands only after every earlier one, the terminal
entry only after all deltas).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from tests.conftest import RedisServer, chat
from tests.support import (
    WorkerProcesses,
    all_terminal,
    check_all,
    eventually,
    mock_process,
    worker_env,
)
from worker.client import Client
from worker.keys import Keys

# -- maxmemory: Redis refuses some commands of a pipeline -----------------------------------


async def squeeze(redis: Redis, rng: random.Random, stop: asyncio.Event) -> int:
    """Until ``stop``: episodes of ``maxmemory`` set just around ``used_memory`` (re-read
    every few milliseconds, so commands are refused and accepted in quick alternation),
    with pauses at no limit between them. Returns the number of episodes."""
    loop = asyncio.get_running_loop()
    episodes = 0
    try:
        while not stop.is_set():
            await asyncio.sleep(rng.uniform(0.1, 0.4))
            until = loop.time() + rng.uniform(0.3, 1.0)
            while loop.time() < until:
                used = int((await redis.info("memory"))["used_memory"])
                await redis.config_set("maxmemory", used + rng.randint(-4096, 32768))
                await asyncio.sleep(rng.uniform(0.002, 0.03))
            await redis.config_set("maxmemory", 0)
            episodes += 1
    finally:
        await redis.config_set("maxmemory", 0)
    return episodes


async def enqueue_refused_or_not(client: Client, request: dict[str, Any], job_id: str) -> str:
    """Enqueue, retrying while Redis refuses it (OOM)."""
    while True:
        try:
            return await client.enqueue(request, job_id=job_id)
        except RedisError:
            await asyncio.sleep(0.01)


def squeezed_request(i: int) -> dict[str, Any]:
    """Many small deltas: one token per chunk, paced so that streams overlap."""
    return chat(f"job {i}", tokens=60 + (i * 37) % 101, rate=300, key=f"m{i}")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
async def test_streams_stay_gapless_while_redis_refuses_writes_at_maxmemory(
    own_redis: RedisServer, prefix: str, tmp_path: Path, seed: int
) -> None:
    keys = Keys(prefix)
    redis = Redis.from_url(own_redis.url, decode_responses=True)
    client = Client(redis, prefix=prefix)
    rng = random.Random(seed)
    jobs = 600
    try:
        async with mock_process(tmp_path) as url:
            env = worker_env(own_redis.url, prefix, url, concurrency=200, log_level="WARNING")
            async with WorkerProcesses.session(tmp_path, env) as group:
                for process in [group.spawn() for _ in range(2)]:
                    await group.ready(process, redis, keys)
                stop = asyncio.Event()
                squeezing = asyncio.create_task(squeeze(redis, rng, stop))
                requests = [squeezed_request(i) for i in range(jobs)]
                ids = []
                for i, request in enumerate(requests):  # jobs keep arriving meanwhile
                    ids.append(await enqueue_refused_or_not(client, request, f"m{seed}-{i}"))
                    await asyncio.sleep(0.002)
                await eventually(lambda: all_terminal(redis, keys, ids), 120, every=0.2)
                stop.set()
                episodes = await squeezing
                output = group.output()
        assert episodes >= 5
        assert "maxmemory" in output  # Redis did refuse the workers' writes
        assert "Traceback" not in output, output
        await check_all(redis, keys, requests, ids)  # every stream gapless and exact
    finally:
        await redis.aclose()
