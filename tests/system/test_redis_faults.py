"""Redis faults on real processes: writes refused at ``maxmemory``, and a Redis that comes
back empty. ``chatstream worker`` subprocesses against a redis-server of the test's own.

What must hold (docs/reliability.md): per job, the events stream is gapless whatever subset
of a pipeline Redis refuses (a delta entry lands only after every earlier one, the terminal
entry only after all deltas), and a worker recreates what it needs when Redis lost it.
"""

from __future__ import annotations

import asyncio
import random
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from tests.helpers.checks import all_terminal, check_all, eventually, is_ready, readiness, statuses
from tests.helpers.fleet import Fleet
from tests.helpers.harness import chat
from tests.helpers.processes import mock_process, stop_worker
from tests.helpers.servers import RedisServer, free_port
from worker.client import Client
from worker.store.keys import Keys

# one at a time on one test process: their workers' leases and heartbeats run on real clocks
pytestmark = pytest.mark.xdist_group("worker-processes")

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
    redis = Redis.from_url(own_redis.url, decode_responses=True)
    rng = random.Random(seed)
    jobs = 600
    try:
        async with (
            mock_process(tmp_path) as url,
            Fleet.session(
                tmp_path, redis, own_redis.url, prefix, url, concurrency=200, log_level="WARNING"
            ) as fleet,
        ):
            keys, client = fleet.keys, fleet.client
            await fleet.start(2)
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
            output = fleet.output()
        assert episodes >= 5
        assert "maxmemory" in output  # Redis did refuse the workers' writes
        assert "Traceback" not in output, output
        await check_all(redis, keys, requests, ids)  # every stream gapless and exact
    finally:
        await redis.aclose()


# -- Redis restarted empty --------------------------------------------------------------------


async def metric(port: int, name: str) -> float:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.slow
async def test_workers_consume_again_after_redis_comes_back_empty(
    own_redis: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """A persistence-less redis-server SIGKILLed mid-run and replaced by an empty one on the
    same port: the workers recreate the consumer group, reload their scripts and run the
    jobs enqueued afterwards within seconds; the running jobs whose records vanished are
    logged and counted once, not looped on; /readyz is 503 while Redis is away."""
    ports = [free_port(), free_port()]
    redis = Redis.from_url(own_redis.url, decode_responses=True)
    try:
        async with (
            mock_process(tmp_path) as url,
            Fleet.session(tmp_path, redis, own_redis.url, prefix, url) as fleet,
        ):
            keys, client = fleet.keys, fleet.client
            workers = [fleet.spawn(metrics_port=port) for port in ports]
            for process in workers:
                await fleet.ready(process)
            lost = [await client.enqueue(chat(f"lost {i}", tokens=60, rate=20)) for i in range(8)]
            await eventually(lambda: _some_running(redis, keys, lost))
            await asyncio.to_thread(own_redis.kill)
            for port in ports:
                status, body = await readiness(port)
                assert status == 503 and body["reason"].startswith("redis at "), body
            await asyncio.to_thread(own_redis.start)  # same port, nothing in it
            began = time.monotonic()
            requests = [chat(f"after {i}", tokens=20, rate=100) for i in range(20)]
            ids = [
                await enqueue_refused_or_not(client, r, f"after-{i}")
                for i, r in enumerate(requests)
            ]
            await eventually(lambda: all_terminal(redis, keys, ids), 20, every=0.1)
            took = time.monotonic() - began
            for port in ports:
                await eventually(partial(is_ready, port), 10)
            missing = sum([await metric(port, "chatstream_jobs_missing_total") for port in ports])
            await asyncio.sleep(3)  # long enough for a loop to show in the logs
            codes = [await stop_worker(process, 15) for process in workers]
            output = fleet.output()
        assert codes == [0, 0], output
        assert "Traceback" not in output, output
        await check_all(redis, keys, requests, ids)
        print(f"\nempty Redis: {len(ids)} new jobs done {took:.1f}s after the restart")
        assert took < 10
        assert missing >= 1  # the jobs that were running when Redis died
        assert all([await redis.exists(keys.job(job_id)) == 0 for job_id in lost])
        assert output.count("consumer group is gone") <= 2 * len(workers), output
        assert output.count("NOGROUP") <= 2 * len(workers), output
        assert output.count("record is gone") <= len(lost), output
    finally:
        await redis.aclose()


async def _some_running(redis: Redis, keys: Keys, ids: list[str]) -> bool:
    return "running" in await statuses(redis, keys, ids)
