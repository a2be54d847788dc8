"""The fleet controls' cost: enqueue rates, and the queue's cost per job with and without
upstream limits, beside the path before the scheduler, in one run on one redis-server.

Everything runs on a redis-server of its own (a free loopback port, no persistence), with
hiredis when installed. Figures (best of ``--rounds``):

enqueue
    ``enqueue()`` one job at a time; ``enqueue_many`` in batches of 1,000; and, as the peer,
    the enqueue before the scheduler (create the record, index it, ``XADD`` the entry, mark
    it queued: four round trips, the same scripts), one job at a time. Jobs/s.
queue
    ``--jobs`` jobs through a reader that takes up to 64 entries per read and acks each:
    entries a producer ``XADD``ed into the stream (the reads of before the scheduler, as
    ``chatstream`` still takes them), the scheduler with no limits, and with every limit
    set (high enough that none holds a job back: what is measured is the bookkeeping), and
    jobs of a route of two targets (``fallback`` and ``weighted``; the targets known to
    answer, as a running fleet keeps them: the route's choice, its health reads and its
    round-robin state are what is measured). Jobs/s, the reader's CPU per job and the
    redis-server's CPU per job (``INFO cpu``).

Run: ``.venv/bin/python bench/bench_fleet.py [--jobs N] [--rounds N] [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from worker.client import Client
from worker.settings import Route, RouteTarget, Settings, Upstream
from worker.store.keys import Keys
from worker.store.queue import Queue
from worker.store.scheduler import config_fields

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "a short question"}]}
TARGETS = {
    "upstreams": {
        "a": Upstream(url="http://127.0.0.1:9/v1"),
        "b": Upstream(url="http://127.0.0.1:9/v1"),
    },
}
ROUTED = {
    **TARGETS,
    "routes": {"fast": Route(targets=[RouteTarget(upstream="a"), RouteTarget(upstream="b")])},
}
WEIGHTED = {
    **TARGETS,
    "routes": {
        "fast": Route(
            strategy="weighted",
            targets=[RouteTarget(upstream="a", weight=1), RouteTarget(upstream="b", weight=3)],
        )
    },
}
LIMITS = {
    "upstream_max_concurrent": 100_000,
    "upstream_requests_per_minute": 10_000_000,
    "upstream_tokens_per_minute": 10_000_000_000,
}


@dataclass
class Row:
    what: str
    jobs: int
    seconds: float
    cpu: float = 0.0
    redis_cpu: float = 0.0

    def line(self) -> str:
        rate = self.jobs / self.seconds
        text = f"  {self.what:<44} {rate:>9,.0f} jobs/s"
        if self.cpu:
            text += f"   {self.cpu / self.jobs * 1e6:6.1f} µs CPU/job here"
            text += f"   {self.redis_cpu / self.jobs * 1e6:6.1f} µs CPU/job in Redis"
        return text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def redis_cpu(redis: Redis) -> float:
    info: dict[str, Any] = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def settings_for(url: str, prefix: str, **updates: Any) -> Settings:
    return Settings(_env_file=None, redis_url=url, prefix=prefix, **updates)


async def enqueue_rates(url: str, jobs: int) -> list[Row]:
    redis = Redis.from_url(url)
    rows = []
    for what, run in (
        ("enqueue(), one at a time", _one_by_one),
        ("enqueue_many(), batches of 1,000", _many),
        ("peer: enqueue before the scheduler (4 trips)", _old_enqueue),
    ):
        n = jobs * 10 if "many" in what else jobs
        client = Client.from_settings(settings_for(url, f"e{time.monotonic_ns()}"), redis)
        began = time.perf_counter()
        await run(client, n)
        rows.append(Row(what, n, time.perf_counter() - began))
    await redis.aclose()
    return rows


async def _one_by_one(client: Client, n: int) -> None:
    for _ in range(n):
        await client.enqueue(REQUEST)


async def _many(client: Client, n: int) -> None:
    await client.enqueue_many([REQUEST] * n)


async def _old_enqueue(client: Client, n: int) -> None:
    for i in range(n):
        spec = client._spec(REQUEST, f"old{i}", "default", {})
        fields = client._fields(spec, {})
        await client.records.create(spec.id, fields)
        await client.index.add(spec.id, float(fields["created_at"]))
        entry = await client.queue.add(spec.id)
        await client.records.mark_queued(spec.id, entry)


async def queue_costs(url: str, jobs: int) -> list[Row]:
    redis = Redis.from_url(url)
    rows = []
    cases: list[tuple[str, dict[str, Any], Callable[[Client, Keys, int], Awaitable[None]]]] = [
        ("peer: entries XADDed into the stream", {}, _raw_entries),
        ("scheduler, no limits", {}, _scheduled),
        ("scheduler, every limit set", LIMITS, _scheduled),
        ("route of 2 targets, fallback", ROUTED, _routed),
        ("route of 2 targets, weighted", WEIGHTED, _routed),
    ]
    for what, updates, fill in cases:
        settings = settings_for(url, f"q{time.monotonic_ns()}", **updates)
        keys = Keys(settings.prefix)
        queue = Queue(redis, keys, "reader")
        await queue.ensure_group()
        await queue.scheduler.publish(config_fields(settings))
        await _answering(redis, keys, settings)
        await fill(Client.from_settings(settings, redis), keys, jobs)
        rows.append(await _drain(redis, queue, what, jobs))
    await redis.aclose()
    return rows


async def _raw_entries(client: Client, keys: Keys, n: int) -> None:
    pipe = client.redis.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(keys.queue, {"job": f"raw{i}"})
    await pipe.execute()


async def _scheduled(client: Client, keys: Keys, n: int) -> None:
    await client.enqueue_many([REQUEST] * n)


async def _routed(client: Client, keys: Keys, n: int) -> None:
    await client.enqueue_many([{**REQUEST, "model": "fast"}] * n)


async def _answering(redis: Redis, keys: Keys, settings: Settings) -> None:
    """A route's targets as a running fleet keeps them: known to answer (workers refresh
    this every second while their jobs get first bytes), so no trial holds jobs back."""
    for _, upstream, model in settings.route_targets():
        await redis.set(f"{keys.sched(0)}:ok:{upstream}|{model}", "1", px=600_000)


async def _drain(redis: Redis, queue: Queue, what: str, jobs: int) -> Row:
    cpu, server, began = time.process_time(), await redis_cpu(redis), time.perf_counter()
    done = 0
    while done < jobs:
        entries = await queue.read(64, None)
        if not entries:
            raise RuntimeError(f"{what}: the queue ran dry after {done} of {jobs}")
        for entry in entries:
            await queue.ack(entry)
        done += len(entries)
    seconds = time.perf_counter() - began
    return Row(what, done, seconds, time.process_time() - cpu, await redis_cpu(redis) - server)


async def measure(url: str, jobs: int, rounds: int) -> tuple[list[Row], list[Row]]:
    redis = Redis.from_url(url)
    for _ in range(200):
        try:
            await redis.ping()
            break
        except RedisConnectionError:
            await asyncio.sleep(0.02)
    await redis.aclose()
    enqueue = [await enqueue_rates(url, jobs // 5) for _ in range(rounds)]
    queue = [await queue_costs(url, jobs) for _ in range(rounds)]
    return _best(enqueue), _best(queue)


def _best(rounds: list[list[Row]]) -> list[Row]:
    return [min(rows, key=lambda row: row.seconds / row.jobs) for rows in zip(*rounds, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args()
    jobs, rounds = (1_000, 1) if args.quick else (args.jobs, args.rounds)
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("bench_fleet needs redis-server on the PATH")
    port = free_port()
    with open("/proc/loadavg") as load:
        print(f"load before the run: {load.read().split()[0]} (1 min)")
    with tempfile.TemporaryDirectory() as directory:
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            enqueue, queue = asyncio.run(measure(f"redis://127.0.0.1:{port}/0", jobs, rounds))
        finally:
            server.terminate()
            server.wait()
    print(f"enqueue (best of {rounds}):")
    print("\n".join(row.line() for row in enqueue))
    print(f"queue, {jobs} jobs read 64 at a time and acked (best of {rounds}):")
    print("\n".join(row.line() for row in queue))


if __name__ == "__main__":
    main()
