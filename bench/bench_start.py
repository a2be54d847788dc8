"""Time to first token on a busy worker: what the wake-up tick adds to a job's start.

One ``chatstream worker`` process (``--chatstream``: another build, for A/B) streams
``--streams`` background jobs at ``--rate`` tokens/s from ``bench/paced_upstream.py`` (its
own process), so its wake-up tick is on; meanwhile a client enqueues one short probe job
every ``--every`` seconds and reads its stream with ``XREAD BLOCK``. Per probe: enqueue ->
the first content entry read (the queue read, the start script, the upstream request, the
mock's first token, the publish and the read, each a hop that waits for I/O), and
enqueue -> the terminal entry. ``CHATSTREAM_WAKE_TICK_MS`` in the environment reaches the
worker. Run: ``.venv/bin/python bench/bench_start.py [--streams 60] [--probes 60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_worker import (
    OURS_PREFIX,
    TERMINAL,
    cpu_seconds,
    job_body,
    mock_upstream,
    redis_server,
    spawn,
)
from redis.asyncio import Redis

from worker.client import Client


async def first_and_last(redis: Redis, key: str, enqueued: float) -> tuple[float, float]:
    """Seconds from ``enqueued`` to the stream's first content entry and to its end."""
    first, last_id = 0.0, "0"
    while True:
        reply: Any = await redis.xread({key: last_id}, block=5000)
        if not reply:
            raise RuntimeError(f"{key}: nothing for 5 s")
        for entry_id, fields in reply[0][1]:
            last_id = entry_id
            kind = fields.get(b"type")
            if not first and kind == b"delta" and b'"content"' in fields.get(b"data", b""):
                first = time.time() - enqueued
            if kind in TERMINAL:
                return first, time.time() - enqueued


async def probe(client: Client, redis: Redis, i: int) -> tuple[float, float]:
    job_id = f"probe-{i}"
    key = f"{OURS_PREFIX}:job:{{{job_id}}}:events"
    enqueued = time.time()
    await client.enqueue(job_body(3, rate=50), job_id=job_id)
    return await first_and_last(redis, key, enqueued)


async def measure(args: argparse.Namespace, redis_url: str, mock_url: str, logs: Path) -> None:
    variables = {
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": OURS_PREFIX,
        "CHATSTREAM_UPSTREAM_URL": mock_url,
        "CHATSTREAM_CONCURRENCY": str(args.streams + 16),
    }
    command = [args.chatstream or str(Path(sys.executable).parent / "chatstream"), "worker"]
    worker = spawn("worker", command, logs, {**os.environ, **variables})
    redis = Redis.from_url(redis_url)
    client = Client(Redis.from_url(redis_url, decode_responses=True), prefix=OURS_PREFIX)
    try:
        await probe(client, redis, -1)  # the worker is up and its connections made
        length = args.every * args.probes + 4
        background = job_body(round(args.rate * length), rate=args.rate)
        for i in range(args.streams):
            await client.enqueue(background, job_id=f"bg-{i}")
        await asyncio.sleep(2)  # every background stream is sending
        cpu_before = cpu_seconds(worker.pid)
        results = []
        for i in range(args.probes):
            began = time.monotonic()
            results.append(await probe(client, redis, i))
            await asyncio.sleep(max(0.0, args.every - (time.monotonic() - began)))
        cpu = (cpu_seconds(worker.pid) - cpu_before) / (args.every * args.probes)
        worker.check()
    finally:
        await client.aclose()
        await redis.aclose()
        worker.stop()
    report(args, results, cpu)


def report(args: argparse.Namespace, results: list[tuple[float, float]], cpu: float) -> None:
    def line(label: str, values: list[float]) -> str:
        ms = sorted(v * 1000 for v in values)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        return (
            f"  {label:<24} p50 {statistics.median(ms):6.1f} ms  p99 {p99:6.1f}  max {ms[-1]:6.1f}"
        )

    tick = os.environ.get("CHATSTREAM_WAKE_TICK_MS", "default")
    print(
        f"{args.probes} probe jobs, one every {args.every:g} s, beside {args.streams} streams "
        f"at {args.rate:g} tokens/s (tick {tick} ms; worker {cpu:.0%} of a core):"
    )
    print(line("enqueue -> first token", [first for first, _ in results]))
    print(line("enqueue -> done", [done for _, done in results]))
    print(json.dumps({"first": [round(f, 5) for f, _ in results]}), file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=60)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--probes", type=int, default=60)
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--chatstream", help="the chatstream executable to run (A/B builds)")
    args = parser.parse_args()
    print(f"machine: 1-minute load {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        logs = Path(directory)
        with redis_server(logs) as (redis_url, _), mock_upstream(logs) as (mock_url, _):
            asyncio.run(measure(args, redis_url, mock_url, logs))


if __name__ == "__main__":
    main()
