"""Pickup latency of an idle worker: how long a job waits between enqueue and start.

One worker (in this process) blocks in XREADGROUP on its own redis-server, started here
on a free loopback port; a client enqueues one job at a time with idle gaps between them.
The figure is the record's ``started_at - created_at`` (both written by the two sides on
this machine), so it covers enqueue's queue write, the wake-up of the blocked read and the
fenced start script. Run: ``.venv/bin/python bench/bench_pickup.py [--jobs N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from worker.aio import cancel_and_wait
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.testing.mock_upstream import serve_mock


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_ready(redis: Redis) -> None:
    for _ in range(200):
        try:
            await redis.ping()
            return
        except RedisConnectionError:
            await asyncio.sleep(0.02)
    raise RuntimeError("redis-server did not start")


async def measure(url: str, jobs: int) -> list[float]:
    redis = Redis.from_url(url, decode_responses=True)
    await wait_ready(redis)
    async with serve_mock(tokens=1) as upstream:
        settings = Settings(_env_file=None, redis_url=url, upstream_url=upstream, prefix="pickup")
        worker = Worker(settings, redis)
        await worker.startup()
        consume = asyncio.create_task(worker.consume())
        client = Client.from_settings(settings, redis)
        request = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        waits = []
        for _ in range(jobs):
            await asyncio.sleep(0.05)  # the worker is idle, blocked in XREADGROUP
            job = await client.enqueue(request)
            record = await client.result(job, timeout=10)
            assert record.started_at is not None and record.created_at is not None
            waits.append((record.started_at - record.created_at) * 1000)
        worker.stopping.set()
        await cancel_and_wait([consume])
        await worker.shutdown()
    await redis.aclose()
    return sorted(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    args = parser.parse_args()
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("bench_pickup needs redis-server on the PATH")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            waits = asyncio.run(measure(f"redis://127.0.0.1:{port}/0", args.jobs))
        finally:
            server.terminate()
            server.wait()
    p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
    print(f"pickup latency of an idle worker over {len(waits)} jobs (created_at -> started_at):")
    print(f"  p50 {statistics.median(waits):.2f} ms   p99 {p99:.2f} ms   max {waits[-1]:.2f} ms")


if __name__ == "__main__":
    main()
