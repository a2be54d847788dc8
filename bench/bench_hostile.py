"""Hostile clients against one gateway process, and Redis's per-job floor (issue 22).

    .venv/bin/python bench/bench_hostile.py            # all three phases: a few minutes
    .venv/bin/python bench/bench_hostile.py --quick    # smaller: under a minute
    .venv/bin/python bench/bench_hostile.py --phase readers --baseline /work/main

Everything runs on loopback: a redis-server of its own per run (free port, no
persistence) and ``chatstream gateway`` (one process) under test.

* ``readers``: N jobs (records owned by the bench's key, running) and one client per job
  that opens ``GET /v1/jobs/{id}/events`` with a 4 KiB receive buffer, reads the response
  head and then nothing. A writer appends an 8 MB reply to every job (entries of
  ``--entry-kb``), then ``done``. Reported: the gateway's RSS before the clients, its peak
  (VmHWM) and what is left at the end, per client, and how many clients it dropped. Runs
  with the default ``CHATSTREAM_GATEWAY_CLIENT_BUFFER_BYTES`` and, with ``--baseline DIR``,
  the gateway of another checkout (``PYTHONPATH=DIR``: the code before this change).
* ``trickle``: M connections that send a request head a byte every 2 s (reconnecting when
  closed, so M stay open), while a legitimate client sends ``GET /v1/jobs/{id}`` on a new
  connection every 50 ms for ``--seconds``. Reported: the legitimate requests' latency
  (p50 / p99 / max) and failures, the heads the gateway timed out, its CPU. With
  ``CHATSTREAM_GATEWAY_HEAD_TIMEOUT`` 10 s and (``off``) 3600 s.
* ``floor``: what one finished job costs Redis 7: jobs of 20 tokens (and 1,000) run by an
  in-process worker against the mock upstream, then ``MEMORY USAGE`` of a job's events
  stream and record, and the growth of ``used_memory`` per job, for
  ``stream-node-max-bytes`` 4096 (Redis's default), 1024 and 256.

Figures are from a 2-core VM shared with other work: ``uptime`` is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as sync_redis
from bench_gateway import KEY, PREFIX, create_jobs
from bench_worker import Proc, cpu_seconds, free_port, peak_rss, spawn, wait_port

CHATSTREAM = str(Path(sys.executable).with_name("chatstream"))
MB = 2**20
AUTH = f"Authorization: Bearer {KEY}"


@dataclass
class Plan:
    readers: int = 200
    reply_mb: float = 8.0
    entry_kb: int = 16
    tricklers: int = 1_000
    seconds: float = 30.0
    floor_jobs: int = 200


QUICK = Plan(readers=20, reply_mb=2.0, tricklers=200, seconds=12.0, floor_jobs=50)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


@contextlib.contextmanager
def redis_server(logs: Path, *args: str) -> Iterator[str]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    base = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn(f"redis-{port}", [binary, *base, *args], logs)
    try:
        wait_port(port, proc.popen)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.stop()


def gateway(logs: Path, redis_url: str, port: int, pythonpath: str = "", **env: str) -> Proc:
    environment = {
        "PATH": "/usr/bin:/bin",
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": PREFIX,
        "CHATSTREAM_GATEWAY_API_KEYS": KEY,
        "CHATSTREAM_GATEWAY_MAX_CONNECTIONS": "1000000",
        "CHATSTREAM_GATEWAY_MAX_STREAMS_PER_KEY": "1000000",
        "CHATSTREAM_LOG_LEVEL": "WARNING",
        **env,
    }
    if pythonpath:
        environment["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "worker.cli", "gateway", "--port", str(port)]
    proc = spawn(f"gateway-{port}", cmd, logs, env=environment)
    wait_port(port, proc.popen)
    return proc


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def health(port: int) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    body: dict[str, Any] = json.loads(data.partition(b"\r\n\r\n")[2] or b"{}")
    return body


# -- readers: clients that stop reading ----------------------------------------------------------


async def non_reader(port: int, job_id: str) -> socket.socket:
    """A connection with a small receive buffer: asks for the job's events, reads the head."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    request = (
        f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer {KEY}\r\n\r\n"
    )
    await loop.sock_sendall(sock, request.encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += await loop.sock_recv(sock, 1)  # byte by byte: nothing past the head
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"events request refused: {head!r}")
    return sock


def write_replies(redis_url: str, jobs: list[str], reply_mb: float, entry_kb: int) -> None:
    """Every job's stream gets a reply of ``reply_mb`` in entries of ``entry_kb``, round robin."""
    client = sync_redis.Redis.from_url(redis_url)
    data = json.dumps({"content": "x" * (entry_kb * 1024 - 14)})
    per_job = int(reply_mb * 1024 / entry_kb)
    for _ in range(per_job):
        with client.pipeline(transaction=False) as pipe:
            for job_id in jobs:
                key = f"{PREFIX}:job:{{{job_id}}}:events"
                pipe.xadd(key, {"type": "delta", "attempt": "1", "data": data})
            pipe.execute()
    with client.pipeline(transaction=False) as pipe:
        for job_id in jobs:
            pipe.xadd(
                f"{PREFIX}:job:{{{job_id}}}:events", {"type": "done", "attempt": "1", "data": "{}"}
            )
        pipe.execute()
    client.close()


async def until_idle(pid: int, limit: float = 120.0) -> int:
    """Until the process used under 5% of a core for a second (it is done with what it
    read), at most ``limit`` seconds; its highest RSS meanwhile."""
    peak, deadline = 0, time.monotonic() + limit
    while time.monotonic() < deadline:
        cpu = cpu_seconds(pid)
        for _ in range(5):
            peak = max(peak, rss(pid))
            await asyncio.sleep(0.2)
        if cpu_seconds(pid) - cpu < 0.05:
            break
    return peak


async def readers_run(label: str, plan: Plan, logs: Path, pythonpath: str = "", **env: str) -> None:
    with redis_server(logs) as redis_url:
        port = free_port()
        proc = gateway(logs, redis_url, port, pythonpath, **env)
        try:
            jobs = create_jobs(redis_url, plan.readers)
            await health(port)
            before = rss(proc.pid)
            socks = [await non_reader(port, job_id) for job_id in jobs]
            opened = (await health(port))["open_streams"]
            writing = asyncio.create_task(
                asyncio.to_thread(write_replies, redis_url, jobs, plan.reply_mb, plan.entry_kb)
            )
            peak = before
            while not writing.done():
                peak = max(peak, rss(proc.pid))
                await asyncio.sleep(0.2)
            await writing
            peak = max(peak, await until_idle(proc.pid))
            after, hwm = rss(proc.pid), peak_rss(proc.pid)
            left = (await health(port))["open_streams"]  # (a dropped one is closed)
            for sock in socks:
                sock.close()
        finally:
            proc.stop()
    per = (max(peak, hwm) - before) / plan.readers
    print(
        f"  {label:<28} clients {plan.readers:4d} (open {opened:4d})  RSS before "
        f"{before / MB:6.1f} MiB  peak {max(peak, hwm) / MB:7.1f}  end {after / MB:7.1f}  "
        f"per client {per / MB:6.2f} MiB  open at the end {left:4d}",
        flush=True,
    )


async def readers_phase(plan: Plan, logs: Path, baseline: str) -> None:
    print(f"readers: {plan.readers} clients that read nothing of {plan.reply_mb:g} MB replies "
          f"({plan.entry_kb} KB entries)   [{uptime()}]", flush=True)  # fmt: skip
    await readers_run("default bound (256 KiB)", plan, logs)
    await readers_run("bound 1 MiB", plan, logs, CHATSTREAM_GATEWAY_CLIENT_BUFFER_BYTES=str(MB))
    if baseline:
        await readers_run(f"baseline {Path(baseline).name}", plan, logs, baseline)


# -- trickle: request heads a byte every 2 s -----------------------------------------------------

HEAD = b"GET /healthz HTTP/1.1\r\nHost: bench\r\nUser-Agent: " + b"s" * 200 + b"\r\n\r\n"


async def trickler(port: int, stop: asyncio.Event, closed: list[int]) -> None:
    """One slow connection at a time, for as long as the run lasts."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        try:
            for byte in HEAD[:-1]:
                if stop.is_set() or reader.at_eof():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        if not await reader.read(1):
                            break
        except ConnectionError:
            pass
        finally:
            closed[0] += 1
            writer.close()


async def legit_request(port: int, path: str) -> float | None:
    """Seconds from connecting to the whole answer of one request, or None when refused."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(10):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            request = f"GET {path} HTTP/1.1\r\nHost: b\r\n{AUTH}\r\nConnection: close\r\n\r\n"
            writer.write(request.encode())
            data = await reader.read()
            writer.close()
    except (OSError, TimeoutError):
        return None
    return time.perf_counter() - start if data.startswith(b"HTTP/1.1 200") else None


async def trickle_run(label: str, plan: Plan, logs: Path, **env: str) -> None:
    with redis_server(logs) as redis_url:
        port = free_port()
        proc = gateway(logs, redis_url, port, **env)
        try:
            [job_id] = create_jobs(redis_url, 1)
            stop, closed = asyncio.Event(), [0]
            slow = [
                asyncio.create_task(trickler(port, stop, closed)) for _ in range(plan.tricklers)
            ]
            await asyncio.sleep(2)  # all connected
            cpu = cpu_seconds(proc.pid)
            times: list[float | None] = []
            deadline = time.monotonic() + plan.seconds
            while time.monotonic() < deadline:
                times.append(await legit_request(port, f"/v1/jobs/{job_id}"))
                await asyncio.sleep(0.05)
            cpu = cpu_seconds(proc.pid) - cpu
            state = await health(port)
            stop.set()
            await asyncio.gather(*slow, return_exceptions=True)
        finally:
            proc.stop()
    ok = sorted(t for t in times if t is not None)

    def p(q: float) -> float:
        return ok[min(len(ok) - 1, int(q * len(ok)))] * 1000 if ok else float("nan")

    print(
        f"  {label:<22} slow {plan.tricklers:5d}  legit {len(times):4d} failed "
        f"{len(times) - len(ok):3d}  p50 {p(0.5):6.1f} ms  p99 {p(0.99):6.1f}  max {p(1.0):6.1f}  "
        f"heads timed out {state.get('heads_timed_out', '-')}  "
        f"open conns {state.get('connections', '-')}  gateway CPU {100 * cpu / plan.seconds:4.0f}%",
        flush=True,
    )


async def trickle_phase(plan: Plan, logs: Path) -> None:
    print(f"trickle: {plan.tricklers} heads a byte per 2 s, a legitimate request every 50 ms "
          f"for {plan.seconds:g} s   [{uptime()}]", flush=True)  # fmt: skip
    await trickle_run("head timeout 10 s", plan, logs)
    await trickle_run("head timeout off", plan, logs, CHATSTREAM_GATEWAY_HEAD_TIMEOUT="3600")


# -- floor: what a finished job costs Redis ------------------------------------------------------


async def floor_run(redis_url: str, tokens: int, jobs: int) -> tuple[int, int, int, float]:
    """(stream bytes, record bytes, entries, used_memory growth per job) of finished jobs."""
    from worker.client import Client
    from worker.service.worker import Worker
    from worker.settings import Settings
    from worker.store.redis_client import redis_from_settings
    from worker.testing.mock_upstream import serve_mock

    async with serve_mock(tokens=tokens) as url:
        prefix = f"floor{tokens}"
        settings = Settings(_env_file=None, redis_url=redis_url, prefix=prefix, upstream_url=url)
        redis: Any = redis_from_settings(settings)
        worker = Worker(settings, redis)
        await worker.startup()
        client = Client.from_settings(settings, redis)
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        used: list[int] = []
        for _ in range(2):  # the first batch pays the fixed costs (dict growth, buffers, ...)
            ids = [await client.enqueue(request) for _ in range(jobs)]
            await worker.run_burst()
            await redis.execute_command("MEMORY", "PURGE")
            used.append(int((await redis.info("memory"))["used_memory"]))
        await worker.shutdown()
    grown = (used[1] - used[0]) / jobs
    keys = client.keys
    stream = await redis.memory_usage(keys.events(ids[-1]), samples=0) or 0
    record = await redis.memory_usage(keys.job(ids[-1]), samples=0) or 0
    entries = await redis.xlen(keys.events(ids[-1]))
    await redis.aclose()
    return stream, record, entries, grown


async def floor_phase(plan: Plan, logs: Path) -> None:
    print(f"floor: a finished job on Redis 7, {plan.floor_jobs} jobs each   [{uptime()}]")
    for node_bytes in (4096, 1024, 256):
        for tokens in (20, 1000):
            with redis_server(logs, "--stream-node-max-bytes", str(node_bytes)) as url:
                stream, record, entries, grown = await floor_run(url, tokens, plan.floor_jobs)
            print(
                f"  stream-node-max-bytes {node_bytes:5d}  {tokens:5d} tokens: stream "
                f"{stream:6d} B ({entries} entries)  record {record:5d} B  "
                f"used_memory per job {grown:8.0f} B",
                flush=True,
            )


async def run(plan: Plan, phases: Sequence[str], baseline: str, logs: Path) -> None:
    if "floor" in phases:
        await floor_phase(plan, logs)
    if "readers" in phases:
        await readers_phase(plan, logs, baseline)
    if "trickle" in phases:
        await trickle_phase(plan, logs)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--phase", action="append", choices=["floor", "readers", "trickle"])
    parser.add_argument("--baseline", default="", help="a checkout whose gateway to compare")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    phases = args.phase or ["floor", "readers", "trickle"]
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as logs:
        os.environ.pop("CHATSTREAM_REDIS_URL", None)
        asyncio.run(run(plan, phases, args.baseline, Path(logs)))


if __name__ == "__main__":
    main()
