"""How many concurrent SSE clients one gateway process serves at p99 <= 50 ms added latency.

    .venv/bin/python bench/bench_gateway.py            # full: a few minutes
    .venv/bin/python bench/bench_gateway.py --quick    # smoke run, < 1 minute

Everything runs on loopback, in separate processes: a redis-server of its own (free port,
no persistence), the gateway under test (``chatstream gateway``, one process), a writer
and one client process. Per step of N:

* N jobs (records owned by the bench's API key), one client per job: the client process
  opens N ``GET /v1/jobs/{id}/events`` streams (OpenAI format, bearer auth) and waits
  until all are open.
* The writer appends delta entries to the N job streams at ``--rate`` entries per second
  each (phases spread evenly), for ``--duration`` seconds, then a ``done`` entry to each.
  It speaks RESP on a raw socket, so it stays cheap next to what it measures.
* The client reads every event's ``id:`` (the Redis entry id, whose first part is the
  Redis server's clock in ms at XADD) and takes receipt time minus that: the **added
  delivery latency** (Redis -> gateway -> HTTP -> client), overstated by up to 1 ms by the
  id's resolution. Only entries written after the first second of writing count (the
  steady state, every client connected).

The ``responses`` system is the same gateway serving the Responses API: each client
opens ``GET /v1/responses/resp_<job>?stream=true`` instead, and the writer puts its own
clock (ms) into each delta's text (one value per write, ~2 ms), which the client reads
back from each ``response.output_text.delta`` event: the same added latency, measured from
the write instead of the entry id (they differ by the XADD's own time, well under 1 ms).

A step passes when every client got every entry and ``[DONE]`` (``response.completed``),
and the p99 is <= 50 ms. N doubles from ``--start`` until a step fails, then is bisected
twice. The peer
(``bench/peer_gateway.py``: one blocking XREAD per client, as an SSE endpoint is usually
written; same uvicorn, same chunk formatting) runs the same steps.

Columns: p50 / p99 / max latency; ev/s = events delivered per second; CPU of each process
(one core = 100%) over the writing period; ``all`` = the whole machine (200% = both cores),
``before`` = the machine in the second before the step (other people's load); RSS = the
gateway's peak; conns = its connections to Redis during the step. On this 2-core machine
the gateway, Redis, the writer and the clients share the cores: the figure is where this
box stops meeting the bound, not a property of the gateway alone; the CPU columns say who
used what.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as sync_redis
from bench_worker import (
    Proc,
    cpu_seconds,
    free_port,
    machine_busy,
    machine_load,
    peak_rss,
    set_autogroup_nice,
    spawn,
    wait_port,
)
from pydantic import SecretStr

from worker.gateway.auth import ApiKeys
from worker.gateway.responses_request import translate

BENCH = Path(__file__).resolve().parent
CHATSTREAM = str(Path(sys.executable).with_name("chatstream"))
KEY = "sk-bench-gateway"
PREFIX = "gwbench"
BOUND_MS = 50.0
BUCKET_MS = 0.1
WARMUP_S = 1.0
ID_MS = re.compile(rb"id: (\d+)-")
DELTA_MS = re.compile(rb'"delta":"(\d+) "')  # the responses system: the writer's clock
DATA = b'{"content":"tok "}'
RESPONSES = "responses"  # the gateway's Responses API, beside its chat format ("ours")


@dataclass
class Plan:
    start: int = 250
    rate: float = 20.0
    duration: float = 10.0
    max_n: int = 16_000
    bisect: int = 2
    per_job: int = 1  # clients reading each job


QUICK = Plan(start=100, rate=20.0, duration=4.0, max_n=400, bisect=0)


@dataclass
class Step:
    system: str
    n: int
    p50: float = 0.0
    p99: float = 0.0
    worst: float = 0.0
    events_per_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    machine: float = 0.0
    before: float = 0.0
    rss: int = 0
    redis_clients: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and self.p99 <= BOUND_MS


# -- the client process ----------------------------------------------------------------------------


class Reader(asyncio.Protocol):
    """One SSE client: records receipt time minus entry time for every event."""

    def __init__(self, request: bytes, tally: Tally, responses: bool = False) -> None:
        self.request = request
        self.tally = tally
        self.times, self.end = (DELTA_MS, b"event: response.completed") if responses else (
            ID_MS, b"data: [DONE]")  # fmt: skip
        self.buffer = b""
        self.headers = True
        self.done = asyncio.get_running_loop().create_future()
        self.opened = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now_ms = time.time() * 1000
        buffer = self.buffer + data
        if self.headers:
            head, sep, buffer = buffer.partition(b"\r\n\r\n")
            if not sep:
                self.buffer = head
                return
            self.headers = False
            if b" 200 " not in head.split(b"\r\n", 1)[0]:
                self.tally.failed += 1
                self.transport.close()
                return
            self.opened.set_result(None)
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.buffer = buffer
            return
        complete, self.buffer = buffer[:cut], buffer[cut + 2 :]
        for ms in self.times.findall(complete):
            self.tally.add(int(ms), now_ms)
        if self.end in complete:
            self.tally.finished += 1
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.opened.done():
            self.opened.set_result(None)
        if not self.done.done():
            self.done.set_result(None)


@dataclass
class Tally:
    finished: int = 0
    failed: int = 0
    events: int = 0
    slots: dict[int, Counter[int]] = field(default_factory=dict)  # second -> latency bucket

    def add(self, entry_ms: int, now_ms: float) -> None:
        self.events += 1
        slot = self.slots.setdefault(entry_ms // 1000, Counter())
        slot[int((now_ms - entry_ms) / BUCKET_MS)] += 1


async def clients(spec: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    tally = Tally()
    readers: list[Reader] = []
    ramp = spec["ramp"] / max(1, len(spec["jobs"]))
    responses = spec.get("system") == RESPONSES
    for i, job_id in enumerate(spec["jobs"]):
        path = f"/v1/responses/resp_{job_id}?stream=true" if responses else (
            f"/v1/jobs/{job_id}/events")  # fmt: skip
        request = (
            f"GET {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {spec['key']}\r\n\r\n"
        ).encode()
        reader = Reader(request, tally, responses)
        await loop.create_connection(lambda: reader, "127.0.0.1", spec["port"])  # noqa: B023
        readers.append(reader)
        await asyncio.sleep(max(0.0, spec["start"] + i * ramp - time.time()))
    await asyncio.gather(*(r.opened for r in readers))
    cpu_connected = time.process_time()
    print("connected", flush=True)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(spec["deadline"] - time.time()):
            await asyncio.gather(*(r.done for r in readers))
    slots = {str(k): dict(v) for k, v in tally.slots.items()}
    result = {"finished": tally.finished, "failed": tally.failed, "events": tally.events,
              "cpu": time.process_time() - cpu_connected}  # fmt: skip
    write_json(spec["out"], {**result, "slots": slots})


def read_json(path: Path) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(path.read_text())
    return value


def write_json(path: str, value: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(value))


# -- the writer process ----------------------------------------------------------------------------


def command(*args: bytes) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    parts += [b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args]
    return b"".join(parts)


def entry(key: bytes, kind: bytes, data: bytes) -> bytes:
    return command(b"XADD", key, b"*", b"type", kind, b"attempt", b"1", b"data", data)


async def writer(spec: dict[str, Any]) -> None:
    """Entry m goes to stream m % n at start + m / (rate * n): every stream at ``rate``."""
    reader, out = await asyncio.open_connection("127.0.0.1", spec["redis_port"])
    keys = [key.encode() for key in spec["keys"]]
    prefixes = [
        command(b"XADD", k, b"*", b"type", b"delta", b"attempt", b"1", b"data", DATA) for k in keys
    ]
    n, per_second = len(keys), spec["rate"] * len(keys)
    total = int(spec["duration"] * per_second)
    replies = asyncio.create_task(count_replies(reader, total + n))
    start = time.time()
    sent = 0
    while sent < total:
        now = time.time()
        due = min(total, int((now - start) * per_second) + 1)
        if spec.get("timestamps"):  # one clock value per write, in each entry's text
            data = b'{"content":"%d "}' % int(now * 1000)
            out.write(b"".join(entry(keys[m % n], b"delta", data) for m in range(sent, due)))
        else:
            out.write(b"".join(prefixes[m % n] for m in range(sent, due)))
        sent = due
        await asyncio.sleep(0.002)
    end = time.time()
    out.write(
        b"".join(
            command(b"XADD", k, b"*", b"type", b"done", b"attempt", b"1", b"data", b"{}")
            for k in keys
        )
    )
    await replies
    write_json(
        spec["out"], {"start": start, "end": end, "entries": total, "cpu": time.process_time()}
    )


async def count_replies(reader: asyncio.StreamReader, expected: int) -> None:
    seen = 0
    while seen < expected * 2:  # a bulk-string reply is two lines
        data = await reader.read(1 << 16)
        if not data or b"-ERR" in data:
            raise RuntimeError(f"redis refused a write: {data[:200]!r}")
        seen += data.count(b"\r\n")


# -- one step --------------------------------------------------------------------------------------


def gateway_proc(system: str, logs: Path, redis_url: str, port: int) -> Proc:
    if system == "peer":
        cmd = [sys.executable, str(BENCH / "peer_gateway.py"), str(port), redis_url, PREFIX]
        return spawn("peer", cmd, logs)
    env = {
        "PATH": "/usr/bin:/bin",
        "CHATSTREAM_REDIS_URL": redis_url,
        "CHATSTREAM_PREFIX": PREFIX,
        "CHATSTREAM_GATEWAY_API_KEYS": KEY,
        "CHATSTREAM_GATEWAY_MAX_CONNECTIONS": "1000000",
        "CHATSTREAM_GATEWAY_MAX_STREAMS_PER_KEY": "1000000",
        "CHATSTREAM_LOG_LEVEL": "WARNING",
    }
    return spawn("gateway", [CHATSTREAM, "gateway", "--port", str(port)], logs, env=env)


def create_jobs(redis_url: str, n: int) -> list[str]:
    """N running jobs of the bench's key, each also a response (the ``response`` field)."""
    owner = ApiKeys.from_setting(SecretStr(KEY)).keys[0].id
    meta = json.dumps({"owner": owner, "model": "bench", "created": int(time.time())})
    echo = translate({"model": "bench", "input": "bench"}).echo
    response = json.dumps({"request_sha256": "", "echo": echo})
    jobs = [f"job-{i}" for i in range(n)]
    client = sync_redis.Redis.from_url(redis_url)
    client.flushall()  # the bench's own server
    fields = {"status": "running", "metadata": meta, "response": response}
    with client.pipeline(transaction=False) as pipe:
        for job_id in jobs:
            pipe.hset(f"{PREFIX}:job:{{{job_id}}}", mapping=fields)  # type: ignore[arg-type]
        pipe.execute()
    client.close()
    return jobs


async def run_child(mode: str, spec: dict[str, Any], logs: Path) -> asyncio.subprocess.Process:
    path = logs / f"{mode}-spec.json"
    write_json(str(path), spec)
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, f"--{mode}", str(path), stdout=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    set_autogroup_nice(child.pid)
    return child


async def measure(system: str, n: int, plan: Plan, logs: Path, redis: tuple[str, int, int]) -> Step:
    redis_url, redis_port, redis_pid = redis
    step = Step(system, n)
    port = free_port()
    gateway = gateway_proc(system, logs, redis_url, port)
    try:
        await asyncio.to_thread(wait_port, port, gateway.popen)
        jobs = create_jobs(redis_url, -(-n // plan.per_job))
        step.before = await asyncio.to_thread(machine_load, 1.0)
        clients = [jobs[i % len(jobs)] for i in range(n)]
        readers = await open_clients(clients, port, plan, logs, system)
        pids = {"gateway": gateway.pid, "redis": redis_pid}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        busy_before = machine_busy()
        stamped = system == RESPONSES
        step.redis_clients = await write_entries(jobs, redis_url, redis_port, plan, logs, stamped)
        cpu_after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        busy, total = (b - a for b, a in zip(machine_busy(), busy_before, strict=True))
        await readers.wait()
        step.rss = peak_rss(gateway.pid)
        wrote, got = read_json(logs / "writer.json"), read_json(logs / "clients.json")
        seconds = wrote["end"] - wrote["start"]
        step.cpu = {k: 100 * (cpu_after[k] - cpu_before[k]) / seconds for k in cpu_after}
        step.cpu["writer"] = 100 * wrote["cpu"] / seconds
        step.cpu["clients"] = 100 * got["cpu"] / seconds
        step.machine = 200 * busy / max(1, total)
        summarize(step, got, wrote, n, len(jobs), done_counts=not stamped)
    finally:
        gateway.stop()
    return step


async def open_clients(
    jobs: list[str], port: int, plan: Plan, logs: Path, system: str
) -> asyncio.subprocess.Process:
    """The client process, once all its streams are open."""
    ramp = max(1.0, len(jobs) / 2000)
    deadline = time.time() + ramp + plan.duration + 30
    spec = {"jobs": jobs, "key": KEY, "port": port, "start": time.time(), "ramp": ramp,
            "deadline": deadline, "out": str(logs / "clients.json"), "system": system}  # fmt: skip
    readers = await run_child("clients", spec, logs)
    assert readers.stdout is not None
    async with asyncio.timeout(ramp + 60):
        line = await readers.stdout.readline()
    if line.strip() != b"connected":
        raise RuntimeError("the clients could not connect")
    return readers


async def write_entries(
    jobs: list[str], redis_url: str, redis_port: int, plan: Plan, logs: Path, stamped: bool
) -> int:
    """Runs the writer (``stamped``: its clock in each delta's text); returns Redis's
    connected clients a second into the writing."""
    keys = [f"{PREFIX}:job:{{{job_id}}}:events" for job_id in jobs]
    spec = {"keys": keys, "redis_port": redis_port, "rate": plan.rate, "timestamps": stamped,
            "duration": plan.duration, "out": str(logs / "writer.json")}  # fmt: skip
    write = await run_child("writer", spec, logs)
    await asyncio.sleep(1.0)
    connected = await asyncio.to_thread(redis_clients, redis_url)
    if await write.wait() != 0:
        raise RuntimeError(f"the writer failed ({write.returncode})")
    return connected


def redis_clients(redis_url: str) -> int:
    """Connections to Redis, less this one and the writer's."""
    client = sync_redis.Redis.from_url(redis_url)
    try:
        return int(client.info("clients")["connected_clients"]) - 2
    finally:
        client.close()


def summarize(
    step: Step,
    got: dict[str, Any],
    wrote: dict[str, Any],
    n: int,
    streams: int,
    *,
    done_counts: bool = True,
) -> None:
    first, last = int(wrote["start"] + WARMUP_S), int(wrote["end"]) - 1
    hist: Counter[int] = Counter()
    for second, buckets in got["slots"].items():
        if first <= int(second) <= last:
            hist.update({int(b): c for b, c in buckets.items()})
    step.events_per_s = got["events"] / max(1e-9, wrote["end"] - wrote["start"])
    step.p50, step.p99 = percentile(hist, 0.50), percentile(hist, 0.99)
    step.worst = max(hist, default=0) * BUCKET_MS
    if got["failed"]:
        step.problems.append(f"{got['failed']} refused")
    if got["finished"] != n:
        step.problems.append(f"{n - got['finished']} unfinished")
    expected = expected_events(wrote["entries"], streams, n, done_counts=done_counts)
    if got["events"] != expected:
        step.problems.append(f"{expected - got['events']} events missing")


def expected_events(entries: int, streams: int, clients: int, *, done_counts: bool = True) -> int:
    """Every client gets its stream's entries and (``done_counts``: an event with the done
    entry's id) the done entry; entry m went to stream m % streams and client i reads stream
    i % streams."""
    total = 0
    for stream in range(streams):
        stream_entries = entries // streams + (stream < entries % streams)
        readers = clients // streams + (stream < clients % streams)
        total += readers * (stream_entries + done_counts)
    return total


def percentile(hist: Counter[int], q: float) -> float:
    total = sum(hist.values())
    if not total:
        return float("inf")
    seen = 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= q * total:
            return (bucket + 1) * BUCKET_MS
    return float("inf")


# -- the search ------------------------------------------------------------------------------------


def line(step: Step) -> str:
    cpu = " ".join(f"{step.cpu.get(k, 0):4.0f}%" for k in ("gateway", "redis", "writer", "clients"))
    verdict = "pass" if step.passed else "FAIL " + ", ".join(step.problems or ["p99 > 50 ms"])
    return (
        f"{step.system:9} {step.n:6d} {step.p50:7.1f} {step.p99:7.1f} {step.worst:7.1f} "
        f"{step.events_per_s:8.0f}  {cpu} {step.machine:4.0f}% {step.before * 200:4.0f}%"
        f" {step.rss / 2**20:6.0f} {step.redis_clients:5d}  {verdict}"
    )


HEADER = (
    "system         N  p50 ms  p99 ms  max ms     ev/s  gateway redis writer clients"
    "  all before RSS MiB conns"
)


async def search(system: str, plan: Plan, logs: Path, redis: tuple[str, int, int]) -> Step | None:
    best: Step | None = None
    low, high, n = 0, 0, plan.start
    while n <= plan.max_n:
        step = await measure(system, n, plan, logs, redis)
        print(line(step), flush=True)
        if not step.passed:
            high = n
            break
        best, low, n = step, n, n * 2
    for _ in range(plan.bisect if high else 0):
        n = (low + high) // 2
        if n in (low, high):
            break
        step = await measure(system, n, plan, logs, redis)
        print(line(step), flush=True)
        if step.passed:
            best, low = step, n
        else:
            high = n
    return best


@contextlib.contextmanager
def redis_server(logs: Path) -> Iterator[tuple[str, int, int]]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn("redis", [binary, *args], logs)
    try:
        wait_port(port, proc.popen)
        yield f"redis://127.0.0.1:{port}/0", port, proc.pid
    finally:
        proc.stop()


async def run(plan: Plan, systems: Sequence[str], logs: Path) -> None:
    print(
        f"{plan.rate:g} entries/s per stream, {plan.per_job} client(s) per stream, "
        f"{plan.duration:g} s per step; logs in {logs}"
    )
    print(HEADER, flush=True)
    best: dict[str, Step | None] = {}
    with redis_server(logs) as redis:
        for system in systems:
            best[system] = await search(system, plan, logs, redis)
    print("\nclients served at p99 <= 50 ms added delivery latency (one process each):")
    for system, step in best.items():
        if step is None:
            print(f"  {system:9} none")
        else:
            cpu, rss = step.cpu.get("gateway", 0), step.rss / 2**20
            print(f"  {system:9} {step.n:6d}  (p99 {step.p99:.1f} ms, gateway CPU {cpu:.0f}%, "
                  f"RSS {rss:.0f} MiB)")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--systems", default=f"ours,{RESPONSES},peer", help=f"any of ours, {RESPONSES}, peer"
    )
    parser.add_argument("--start", type=int, help="the first N")
    parser.add_argument("--rate", type=float, help="entries per second per stream")
    parser.add_argument("--duration", type=float, help="seconds of writing per step")
    parser.add_argument("--per-job", type=int, help="clients per job (default 1)")
    parser.add_argument("--nice", type=int, default=0, help="run everything at this niceness")
    parser.add_argument("--clients", help=argparse.SUPPRESS)
    parser.add_argument("--writer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clients:
        asyncio.run(clients(json.loads(Path(args.clients).read_text())))
        return
    if args.writer:
        asyncio.run(writer(json.loads(Path(args.writer).read_text())))
        return
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by every process started
    plan = QUICK if args.quick else Plan()
    for name in ("start", "rate", "duration", "per_job"):
        if getattr(args, name) is not None:
            setattr(plan, name, getattr(args, name))
    logs = BENCH / ".gateway-logs"
    logs.mkdir(exist_ok=True)
    asyncio.run(run(plan, args.systems.split(","), logs))


if __name__ == "__main__":
    main()
