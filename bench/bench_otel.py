"""The worker's CPU per job with OpenTelemetry tracing on vs off (issue 25).

Run: ``.venv/bin/python bench/bench_otel.py`` (full: about 3 minutes on a quiet machine)
or ``--quick`` (a smoke run, about a minute). bench/README.md explains how to read it.

Two ``chatstream worker`` processes on one Redis (started here on a free loopback port)
and one upstream (``bench/paced_upstream.py``, OpenAI-shaped chunks, one event per write),
on different key prefixes: ``off`` without any OTEL_* variable, ``on`` exporting traces and
metrics over OTLP/HTTP to a sink in this process (which answers 200 and counts what it
gets over HTTP/1.1, as a collector does). One round: ``jobs`` jobs of ``tokens`` tokens,
enqueued at once; the measure is the worker's utime + stime (/proc/<pid>/stat) over the
round, per job. Both workers run each round at once, pinned to one CPU (everything else
on the others), so a slow phase of the machine hits both alike. A round's measure ends
``SETTLE`` seconds after its last job: the batch span processor exports on its own thread
up to its schedule delay (5 s) later, and that export belongs to the round; what each
worker uses when idle (measured over the same time before the rounds: its timers, the
periodic metric export) is taken out of every round. Two workloads:

unpaced
    the upstream sends as fast as the socket takes it (16 events per write)
paced
    ``rate`` tokens per second per stream (a provider's pace: one event per read)

Target: tracing on costs at most 15% more CPU per job (a span per attempt, not per token),
judged on the median of the rounds' on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from statistics import median
from typing import Any, ClassVar

from bench_worker import (
    Proc,
    cpu_seconds,
    job_body,
    mock_upstream,
    redis_server,
    spawn,
    spread,
    wait_terminals,
)
from redis.asyncio import Redis

TARGET = 0.15  # at most 15% more CPU per job with tracing on
SETTLE = 5.5  # seconds after a round's last job, inside its measure (the SDK's export delay: 5)


@dataclass(frozen=True)
class Plan:
    jobs: int = 200
    tokens: int = 200
    rate: float = 50.0  # tokens/s per stream in the paced workload
    rounds: int = 5


QUICK = Plan(jobs=40, tokens=200, rate=100.0, rounds=1)


class Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that takes everything and keeps only counts; HTTP/1.1 keeps
    the exporter's connection open, as a collector does (HTTP/1.0 made every export a
    new connection)."""

    protocol_version = "HTTP/1.1"
    counts: ClassVar[dict[str, int]] = {"requests": 0, "bytes": 0}

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        Sink.counts["requests"] += 1
        Sink.counts["bytes"] += length
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def otlp_sink() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def start_worker(
    mode: str,
    redis_url: str,
    mock_url: str,
    endpoint: str,
    logs: Path,
    extra: dict[str, str],
    cpu: int | None = None,
) -> Proc:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATSTREAM_", "OTEL_"))}
    env.update(
        CHATSTREAM_REDIS_URL=redis_url,
        CHATSTREAM_PREFIX=f"bench-{mode}",
        CHATSTREAM_UPSTREAM_URL=mock_url,
        CHATSTREAM_CONCURRENCY="512",
        CHATSTREAM_LOG_LEVEL="WARNING",
    )
    if mode == "on":
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_SERVICE_NAME="chatstream-bench",
            OTEL_METRIC_EXPORT_INTERVAL="5000",
        )
        env.update(extra)
    command = [str(Path(sys.executable).parent / "chatstream"), "worker"]
    if cpu is not None:  # both workers share one CPU: its slow phases hit both alike
        command = ["taskset", "-c", str(cpu), *command]
    return spawn(f"worker-{mode}", command, logs, env)


async def idle_rates(workers: dict[str, Proc]) -> dict[str, float]:
    """CPU seconds per second each worker uses with nothing to do."""
    before = {mode: cpu_seconds(worker.pid) for mode, worker in workers.items()}
    await asyncio.sleep(SETTLE * 2)
    idle = {}
    for mode, worker in workers.items():
        idle[mode] = (cpu_seconds(worker.pid) - before[mode]) / (SETTLE * 2)
        print(f"  idle {mode:<3}: {idle[mode] * 1000:.1f} ms of CPU per second", flush=True)
    return idle


async def one_round(
    redis: Redis,
    worker: Proc,
    mode: str,
    tag: str,
    jobs: int,
    body: dict[str, Any],
    idle: float = 0.0,
) -> float:
    """CPU seconds of ``worker`` per job, over ``jobs`` jobs enqueued at once, less its
    ``idle`` CPU per second over the settling time."""
    from worker.client import Client

    client = Client(redis, prefix=f"bench-{mode}")
    ids = [f"{tag}-{i}" for i in range(jobs)]
    before = cpu_seconds(worker.pid)
    jobs_to_run = [(job_id, body) for job_id in ids]
    await spread(jobs_to_run, 0.0, lambda job: client.enqueue(job[1], job_id=job[0]))
    keys = [client.keys.events(job_id) for job_id in ids]
    _, types = await wait_terminals(redis, keys, worker, 300.0)
    if types != {"done": jobs}:
        raise RuntimeError(f"{mode}: {dict(types)}")
    await asyncio.sleep(SETTLE)  # the round's spans leave through the exporter's thread
    return (cpu_seconds(worker.pid) - before - idle * SETTLE) / jobs


async def workload(
    redis: Redis, workers: dict[str, Proc], name: str, plan: Plan, body: dict[str, Any]
) -> dict[str, float]:
    """Median CPU per job of each mode and the median of the rounds' on/off ratios; each
    round runs both workers at once (after a warm-up round)."""
    per_job: dict[str, list[float]] = {mode: [] for mode in workers}
    ratios: list[float] = []

    async def both(tag: str, jobs: int, idle: dict[str, float]) -> dict[str, float]:
        rounds = (
            one_round(redis, worker, mode, tag, jobs, body, idle.get(mode, 0.0))
            for mode, worker in workers.items()
        )
        return dict(zip(workers, await asyncio.gather(*rounds), strict=True))

    await both(f"{name}-warm", 20, {})
    idle = await idle_rates(workers)
    for n in range(plan.rounds):
        used = await both(f"{name}{n}", plan.jobs, idle)
        for mode, value in used.items():
            per_job[mode].append(value)
        ratios.append(used["on"] / used["off"])
        print(f"  {name:<8} round {n + 1}: off {used['off'] * 1000:6.2f} on "
              f"{used['on'] * 1000:6.2f} ms/job  {ratios[-1] - 1:+6.1%}", flush=True)  # fmt: skip
    found = {mode: median(values) for mode, values in per_job.items()}
    found["ratio"], found["low"], found["high"] = median(ratios), min(ratios), max(ratios)
    return found


async def run(
    plan: Plan, logs: Path, extra: dict[str, str], only: str | None = None
) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpu = cpus[-1] if len(cpus) > 1 else None
    if worker_cpu is not None:  # Redis, the upstream, the sink and this loop: the others
        os.sched_setaffinity(0, set(cpus[:-1]))
    with (
        redis_server(logs) as (redis_url, _),
        mock_upstream(logs) as (mock_url, _),
        otlp_sink() as endpoint,
    ):
        workers = {mode: start_worker(mode, redis_url, mock_url, endpoint, logs, extra, worker_cpu)
                   for mode in ("off", "on")}  # fmt: skip
        redis = Redis.from_url(redis_url)
        try:
            bodies = {
                "unpaced": job_body(plan.tokens),
                "paced": job_body(plan.tokens, rate=plan.rate),
            }
            for name, body in bodies.items():
                if only is not None and name != only:
                    continue
                results[name] = await workload(redis, workers, name, plan, body)
        finally:
            await redis.aclose()
            for worker in workers.values():
                worker.stop()
    return results


def report(results: dict[str, dict[str, float]], plan: Plan) -> bool:
    print(f"\nCPU per job, {plan.tokens}-token jobs, {plan.jobs} at once, median of "
          f"{plan.rounds} round(s); paced at {plan.rate:g} tokens/s")  # fmt: skip
    print(f"{'workload':<9} {'off ms/job':>11} {'on ms/job':>10} {'overhead':>9} "
          f"{'rounds from':>12} {'to':>6}  target <= 15%")  # fmt: skip
    ok = True
    for name, modes in results.items():
        overhead = modes["ratio"] - 1
        ok &= overhead <= TARGET
        verdict = "ok" if overhead <= TARGET else "OVER"
        print(f"{name:<9} {modes['off'] * 1000:11.2f} {modes['on'] * 1000:10.2f} "
              f"{overhead:+9.1%} {modes['low'] - 1:+12.1%} {modes['high'] - 1:+6.1%}  "
              f"{verdict}")  # fmt: skip
    print(f"OTLP sink: {Sink.counts['requests']} export requests, {Sink.counts['bytes']:,} bytes")
    return ok and Sink.counts["requests"] > 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--rounds", type=int, help="rounds per workload and mode")
    parser.add_argument("--jobs", type=int, help="jobs per round")
    parser.add_argument(
        "--on-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the traced worker only, e.g. OTEL_METRICS_EXPORTER=none",
    )
    parser.add_argument("--only", choices=("unpaced", "paced"), help="one workload only")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    plan = Plan(args.jobs or plan.jobs, plan.tokens, plan.rate, args.rounds or plan.rounds)
    extra = dict(item.split("=", 1) for item in args.on_env)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chatstream-bench-otel-") as directory:
        results = asyncio.run(run(plan, Path(directory), extra, args.only))
    ok = report(results, plan)
    print(f"({time.monotonic() - began:.0f} s)")
    if not ok and not args.quick:
        sys.exit(1)


if __name__ == "__main__":
    main()
