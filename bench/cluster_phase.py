"""bench_worker.py's ``cluster`` phase: the same chatstream workers on one redis-server and
on a 3-master Redis Cluster (tests/helpers/deployments.py starts it on free loopback ports).

``WORKERS`` worker processes with ``CHATSTREAM_QUEUE_SHARDS=3`` in both setups; ``tp_jobs``
jobs of ``tp_tokens`` tokens from an unpaced upstream, all enqueued at once; ``rounds``
rounds after a warm-up, the median reported. Deltas/s = content tokens in the job streams /
(last terminal entry - first enqueue); CPU s per 1k deltas for the workers together and for
the Redis processes together (one, or the three masters).

What it can show on one machine: whether a cluster costs the workers and Redis more per
token (the publisher's one write per master, the cluster client's routing), and that the
job rate is not held by one queue stream. What it cannot: scaling. The masters, workers and
the mock share the same cores, so a cluster gets no more CPU than one server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # tests/helpers/deployments.py: the cluster harness

WORKERS = 2
SHARDS = 3
PREFIX = "bench-cluster"
Spawn = Callable[..., Any]  # bench_worker.spawn(name, command, logs, env) -> Proc
Server = Callable[[Path], AbstractContextManager[tuple[str, int]]]  # its redis_server


@dataclass
class Round:
    tokens: int
    wall: float
    worker_cpu: float
    redis_cpu: float

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


@dataclass
class Result:
    setup: str
    rounds: list[Round]

    @property
    def median(self) -> Round:
        return sorted(self.rounds, key=lambda r: r.rate)[len(self.rounds) // 2]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def three_masters(logs: Path) -> Iterator[tuple[str, list[int]]]:
    from tests.helpers.deployments import cluster

    with cluster(masters=3, parent=logs) as deployment:
        pids = [node.process.pid for node in deployment.masters if node.process is not None]
        yield deployment.cluster_url, pids


async def run_round(
    url: str, redis_pids: list[int], worker_pids: list[int], jobs: int, tokens: int, tag: str
) -> Round:
    from worker.client import Client
    from worker.settings import Settings

    settings = Settings(_env_file=None, redis_url=url, prefix=PREFIX, queue_shards=SHARDS)
    client = await Client.connect(settings)
    try:
        ids = [f"{tag}-{i}" for i in range(jobs)]
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}]}
        request = {**body, "mock": {"tokens": tokens}}
        before = [cpu_seconds(pid) for pid in worker_pids], [cpu_seconds(p) for p in redis_pids]
        first = time.time()
        for at in range(0, jobs, 50):
            await asyncio.gather(*(client.enqueue(request, job_id=i) for i in ids[at : at + 50]))
        last = await last_terminal(client, ids)
        worker_cpu = sum(cpu_seconds(pid) for pid in worker_pids) - sum(before[0])
        redis_cpu = sum(cpu_seconds(pid) for pid in redis_pids) - sum(before[1])
        counted = await content_tokens(client, ids)
        if counted != jobs * tokens:
            raise RuntimeError(f"{url}: {counted} of {jobs * tokens} tokens")
        return Round(counted, last - first, worker_cpu, redis_cpu)
    finally:
        await client.aclose()


async def last_terminal(client: Any, ids: list[str], timeout: float = 300.0) -> float:
    """Waits until every job ended ``done``; the Redis time of the last terminal entry."""
    deadline = time.monotonic() + timeout
    pending = set(ids)
    last_ms = 0
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} jobs unfinished")
        order = list(pending)
        pipe = client.redis.pipeline(transaction=False)
        for job_id in order:
            pipe.xrevrange(client.keys.events(job_id), count=1)
        for job_id, entries in zip(order, await pipe.execute(), strict=True):
            if entries and entries[0][1].get("type") in ("done", "error", "cancelled"):
                if entries[0][1]["type"] != "done":
                    raise RuntimeError(f"job {job_id} ended {entries[0][1]['type']}")
                pending.discard(job_id)
                last_ms = max(last_ms, int(entries[0][0].split("-")[0]))
        await asyncio.sleep(0.05)
    return last_ms / 1000


async def content_tokens(client: Any, ids: list[str]) -> int:
    import json

    pipe = client.redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.xrange(client.keys.events(job_id))
    total = 0
    for entries in await pipe.execute():
        for _, fields in entries:
            if fields.get("type") == "delta":
                total += str(json.loads(fields["data"]).get("content", "")).count("tok")
    return total


async def measure(
    setup: str, redis: tuple[str, list[int]], env: Any, spawn: Spawn, rounds: int
) -> Result:
    url, redis_pids = redis
    jobs, tokens = env.plan.tp_jobs, env.plan.tp_tokens
    variables = {
        "CHATSTREAM_REDIS_URL": url,
        "CHATSTREAM_PREFIX": PREFIX,
        "CHATSTREAM_UPSTREAM_URL": env.mock_url,
        "CHATSTREAM_QUEUE_SHARDS": str(SHARDS),
        "CHATSTREAM_CONCURRENCY": str(max(256, jobs)),
    }
    chatstream = env.plan.chatstream or str(Path(sys.executable).parent / "chatstream")
    workers = [
        spawn(f"cluster-worker-{i}", [chatstream, "worker"], env.logs, {**os.environ, **variables})
        for i in range(WORKERS)
    ]
    try:
        pids = [worker.pid for worker in workers]
        tag = setup.replace(" ", "-")
        await run_round(url, redis_pids, pids, 8, 20, f"{tag}-warm")
        done = [
            await run_round(url, redis_pids, pids, jobs, tokens, f"{tag}-{n}")
            for n in range(rounds)
        ]
        return Result(setup, done)
    finally:
        for worker in workers:
            worker.stop()


async def cluster_phase(env: Any, spawn: Spawn, redis_server: Server) -> list[Result]:
    """Both setups, one after the other: ``redis_server`` is bench_worker's (one server,
    its pid), ``spawn`` its process starter."""

    @contextlib.contextmanager
    def one_server(logs: Path) -> Iterator[tuple[str, list[int]]]:
        with redis_server(logs) as (url, pid):
            yield url, [pid]

    rounds = max(1, env.plan.tp_rounds)
    results = []
    for setup, deployment in (("one server", one_server), ("3-master cluster", three_masters)):
        with deployment(env.logs) as redis:
            result = await measure(setup, redis, env, spawn, rounds)
        results.append(result)
        for r in result.rounds:
            print(
                f"  cluster phase, {setup:<17}: {r.rate:9,.0f} deltas/s, worker CPU "
                f"{r.worker_cpu / r.tokens * 1000:.3f} s/1k, redis CPU "
                f"{r.redis_cpu / r.tokens * 1000:.3f} s/1k ({r.tokens:,} in {r.wall:.2f}s)",
                flush=True,
            )
    return results


def cluster_table(results: list[Result]) -> list[str]:
    lines = [
        f"cluster: the same {WORKERS} chatstream workers (queue in {SHARDS} shards), upstream "
        "unpaced, median round",
        "| setup | deltas/s | each round | worker CPU s / 1k deltas | Redis CPU s / 1k deltas |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        r = result.median
        each = ", ".join(f"{x.rate:,.0f}" for x in result.rounds)
        lines.append(
            f"| {result.setup} | {r.rate:,.0f} | {each} | {r.worker_cpu / r.tokens * 1000:.3f} "
            f"| {r.redis_cpu / r.tokens * 1000:.3f} |"
        )
    return lines
