"""End-to-end worker benchmark: chatstream vs arq + the openai SDK (what users write today).

Run: ``.venv/bin/python bench/bench_worker.py`` (full, about 5-10 minutes) or ``--quick``
(a smoke run under a minute once ``bench/.peer-venv`` exists). bench/README.md explains
the setup and how to read the table. One run, one machine, one Redis (started here on a
free loopback port), one mock upstream process, the two workers one after the other:

throughput
    ``tp_jobs`` jobs of ``tp_tokens`` tokens, upstream unpaced (rate 0), one worker
    process. Deltas/s = content tokens found in the job streams / (last terminal entry's
    time - first enqueue). CPU s per 1k deltas = the worker process's utime+stime
    (/proc/<pid>/stat) over the round, per 1,000 tokens. Median of ``tp_rounds`` rounds.
capacity
    N concurrent streams at ``rate`` tokens/s for ``duration`` s each (the mock's
    ``timestamps`` make every token its send time; ``tick`` coalesces the mock's writes),
    enqueued evenly over ``ramp`` s; a consumer process (multi-key ``XREAD BLOCK``)
    computes receipt time - send time for every token. A step passes when every stream
    ended ``done`` with every token, all N streams were sending together for at least half
    the duration, and the p99 of the tokens sent while all N were sending is <= 50 ms (the
    p99 over every token, ramp and wind-down included, is shown beside it). N doubles
    until a step fails, then is bisected ``refine`` times. Reported: the largest passing N
    and the worker's peak RSS (VmHWM) at that step.

The consumer runs under ``bench/.peer-venv``'s interpreter (redis-py with hiredis), so
this module imports only the standard library and redis at the top level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from redis.asyncio import Redis

BENCH = Path(__file__).resolve().parent
PEER_VENV = BENCH / ".peer-venv"
PEER_PYTHON = PEER_VENV / "bin" / "python"
PEER_SCRIPT = BENCH / "peer_arq.py"
PEER_PINS = ("arq==0.26.3", "openai==3.57.0", "redis[hiredis]==5.3.1", "hiredis==3.5.0")
OURS_PREFIX = "bench"
PEER_PREFIX = "peer"  # peer_arq.events_key
TERMINAL = frozenset({b"done", b"error", b"cancelled"})
LATENCY_BOUND = 0.050
BUCKET = 1e-4  # latency histogram resolution: 0.1 ms
BUCKETS = 100_000  # 10 s; anything later lands in the last bucket
SLOT = 0.1  # latencies are kept per 100 ms of send time
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
CPUS = os.cpu_count() or 1
QUIET = 0.25  # a capacity step waits until the CPUs are at most this busy without it
BUSY = 0.30  # ...and is marked "busy" (no ratio from it) when they were busier than this
RESOLUTION = 0.10  # bisect until the first failing N is within 10% of the last passing one
LONG_ROUNDS = 20.0  # no more throughput rounds once this many seconds were measured


@dataclass(frozen=True)
class Plan:
    tp_jobs: int = 200
    tp_tokens: int = 500
    tp_rounds: int = 3
    duration: float = 10.0
    rate: float = 50.0
    tick: float = 0.0  # 0: one event per write (providers' pacing); > 0: coalescing mock
    ramp: float = 1.0
    start_ours: int = 200
    start_peer: int = 25
    max_streams: int = 6400
    refine: int = 6  # most bisection steps (they stop at RESOLUTION)
    light: int = 60  # a fixed light-load step (tens of streams: ordinary load), both systems
    keys_per_read: int = 100
    consumers: int = 1
    phases: tuple[str, ...] = ("throughput", "capacity", "tls", "memory", "cluster")
    coalesced_tick: float = 0.1  # the extra "coalesced" phase's mock tick
    memory_streams: int = 1000
    memory_rate: float = 5.0  # slow enough that the CPU does not limit the memory phase
    quiet_budget: float = 120.0  # seconds the capacity steps may wait for other processes
    verbose: bool = False
    steps: tuple[int, ...] = ()  # run exactly these capacity steps instead of searching
    chatstream: str = ""  # the chatstream executable (default: beside this interpreter)


QUICK = Plan(
    tp_jobs=50, tp_tokens=200, tp_rounds=1, duration=3.0, ramp=0.5,
    start_ours=50, start_peer=25, max_streams=100, refine=1, quiet_budget=5.0,
    memory_streams=200,
)  # fmt: skip


# --- processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:g}s")


def spawn(name: str, cmd: Sequence[str], logs: Path, env: dict[str, str] | None = None) -> Proc:
    log = (logs / f"{name}.log").open("ab")
    popen = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=logs, start_new_session=True
    )
    set_autogroup_nice(popen.pid)
    return Proc(name, popen, logs / f"{name}.log", log)


def set_autogroup_nice(pid: int) -> None:
    """Give the process's session (its scheduler autogroup) this run's niceness.

    With ``kernel.sched_autogroup_enabled`` the CPUs are shared between sessions first, so a
    process's own nice value only ranks it within its session; ``--nice`` sets both.
    """
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))


@dataclass
class Proc:
    """A child process (in its own session) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    log: Any

    @property
    def pid(self) -> int:
        return self.popen.pid

    def check(self) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that ended (consumers, enqueuers)."""
    me, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def voluntary_switches(pid: int) -> int:
    """How often the process went to sleep and was woken (all its threads' counts)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def peak_rss(pid: int) -> int:
    """VmHWM of the process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def machine_load(seconds: float = 1.0) -> float:
    """The fraction of all CPUs busy over the next ``seconds``."""
    before = machine_busy()
    time.sleep(seconds)
    after = machine_busy()
    return (after[0] - before[0]) / max(1, after[1] - before[1])


@contextlib.contextmanager
def redis_server(logs: Path) -> Iterator[tuple[str, int]]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = spawn("redis", [binary, *args], logs)
    try:
        wait_port(port, proc.popen)
        yield f"redis://127.0.0.1:{port}/0", proc.pid
    finally:
        proc.stop()


@contextlib.contextmanager
def mock_upstream(logs: Path, tls: tuple[Path, Path] | None = None) -> Iterator[tuple[str, int]]:
    """``bench/paced_upstream.py`` in its own process (uvloop when installed): one event per
    write, OpenAI-shaped chunks; over TLS with ``tls`` = (certificate, key)."""
    port = free_port()
    extra = ["--tls", str(tls[0]), str(tls[1])] if tls else []
    name = "mock-tls" if tls else "mock"
    proc = spawn(name, [sys.executable, str(BENCH / "paced_upstream.py"), str(port), *extra], logs)
    try:
        wait_port(port, proc.popen)
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1", proc.pid
    finally:
        proc.stop()


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 made now (cryptography, a dev extra): the
    mock's, and the CA file both workers trust through ``SSL_CERT_FILE``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "mock-cert.pem", directory / "mock-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def ensure_peer_venv() -> None:
    """bench/.peer-venv with the pinned peer packages, built once and reused."""
    stamp = PEER_VENV / "bench-pins.txt"
    pins = "\n".join(PEER_PINS)
    if PEER_PYTHON.exists() and stamp.exists() and stamp.read_text() == pins:
        return
    print("building bench/.peer-venv (once): " + " ".join(PEER_PINS), flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    pip = [str(PEER_PYTHON), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, *PEER_PINS], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        raise RuntimeError("pip install into bench/.peer-venv failed")
    stamp.write_text(pins)


# --- the two systems ----------------------------------------------------------------------


@dataclass
class Env:
    plan: Plan
    redis_url: str
    mock_url: str
    logs: Path
    redis: Redis
    helpers: dict[str, int]  # name -> pid of the mock upstream and redis-server
    quiet_budget: float = 0.0  # seconds left to wait for other processes
    ca_file: str = ""  # SSL_CERT_FILE for both workers when the mock speaks TLS
    tick: float = 0.0  # the mock's tick in the capacity steps


Job = tuple[str, dict[str, Any]]


def job_body(tokens: int, **mock: Any) -> dict[str, Any]:
    return {
        "model": "mock-model",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "mock": {"tokens": tokens, **mock},
    }


class System(Protocol):
    name: str
    label: str

    def key(self, job_id: str) -> str: ...

    def start(self, env: Env, concurrency: int) -> Proc: ...

    async def enqueue(self, env: Env, jobs: list[Job], ramp: float) -> float:
        """Enqueue ``jobs`` spread over ``ramp`` seconds; returns the first enqueue's time."""
        ...


async def spread(jobs: list[Job], ramp: float, submit: Callable[[Job], Awaitable[Any]]) -> float:
    """Submit ``jobs`` evenly over ``ramp`` seconds (0: at once), at most 50 calls at a time.

    Up to 250 slices: starts land on many phases of the mock's ``tick``, so the streams'
    writes do not arrive at the worker in a few synchronized bursts.
    """
    slices = min(len(jobs), 250) if ramp > 0 else 1
    size = math.ceil(len(jobs) / slices)
    first = time.time()
    for i in range(slices):
        part = jobs[i * size : (i + 1) * size]
        for at in range(0, len(part), 50):
            await asyncio.gather(*(submit(job) for job in part[at : at + 50]))
        await asyncio.sleep(max(0.0, first + ramp * (i + 1) / slices - time.time()))
    return first


class Ours:
    name = "ours"
    label = "chatstream"

    def key(self, job_id: str) -> str:
        return f"{OURS_PREFIX}:job:{{{job_id}}}:events"

    def start(self, env: Env, concurrency: int) -> Proc:
        variables = {
            "CHATSTREAM_REDIS_URL": env.redis_url,
            "CHATSTREAM_PREFIX": OURS_PREFIX,
            "CHATSTREAM_UPSTREAM_URL": env.mock_url,
            "CHATSTREAM_CONCURRENCY": str(concurrency),
            "CHATSTREAM_LOG_LEVEL": "INFO",  # the start-up line: loop, parser, transport in use
            **({"SSL_CERT_FILE": env.ca_file} if env.ca_file else {}),
        }
        command = [env.plan.chatstream or str(Path(sys.executable).parent / "chatstream"), "worker"]
        return spawn("ours-worker", command, env.logs, {**os.environ, **variables})

    async def enqueue(self, env: Env, jobs: list[Job], ramp: float) -> float:
        from worker.client import Client

        client = Client(Redis.from_url(env.redis_url, decode_responses=True), prefix=OURS_PREFIX)
        try:
            return await spread(jobs, ramp, lambda job: client.enqueue(job[1], job_id=job[0]))
        finally:
            await client.aclose()


class Peer:
    name = "peer"
    label = "arq + openai SDK"

    def key(self, job_id: str) -> str:
        return f"{PEER_PREFIX}:{{{job_id}}}:events"

    def start(self, env: Env, concurrency: int) -> Proc:
        command = [str(PEER_PYTHON), str(PEER_SCRIPT), "worker", "--redis", env.redis_url]
        command += ["--upstream", env.mock_url, "--max-jobs", str(concurrency)]
        variables = {"SSL_CERT_FILE": env.ca_file} if env.ca_file else {}
        return spawn(
            "peer-worker",
            [*command, "--prefix", PEER_PREFIX],
            env.logs,
            {**os.environ, **variables},
        )

    async def enqueue(self, env: Env, jobs: list[Job], ramp: float) -> float:
        path = env.logs / "peer-jobs.json"
        path.write_text(json.dumps([{"id": job_id, "body": body} for job_id, body in jobs]))
        proc = await asyncio.create_subprocess_exec(
            str(PEER_PYTHON), str(PEER_SCRIPT), "enqueue", "--redis", env.redis_url,
            "--jobs", str(path), "--ramp", str(ramp), stdout=subprocess.PIPE,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"peer enqueue failed ({proc.returncode})")
        return float(json.loads(out)["first"])


# --- reading the job streams --------------------------------------------------------------


def entry_content(fields: dict[bytes, bytes]) -> str:
    """The content text of a delta entry of either system ('' for other entries)."""
    if fields.get(b"type") != b"delta":
        return ""
    if b"content" in fields:  # peer: the raw text
        return fields[b"content"].decode()
    data = json.loads(fields.get(b"data", b"{}"))  # ours: compact JSON
    return str(data.get("content") or "")


async def wait_terminals(
    redis: Redis, keys: list[str], proc: Proc, timeout: float
) -> tuple[float, Counter[str]]:
    """Poll until every stream has a terminal entry: (last terminal time, terminal types)."""
    pending, types, last_ms = set(keys), Counter[str](), 0
    deadline = time.monotonic() + timeout
    while pending:
        proc.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} of {len(keys)} jobs unfinished after {timeout}s")
        order = list(pending)
        pipe = redis.pipeline(transaction=False)
        for key in order:
            pipe.xrevrange(key, count=1)
        for key, entries in zip(order, await pipe.execute(), strict=True):
            if entries and entries[0][1].get(b"type") in TERMINAL:
                pending.discard(key)
                types[entries[0][1][b"type"].decode()] += 1
                last_ms = max(last_ms, int(entries[0][0].split(b"-")[0]))
        if pending:
            await asyncio.sleep(0.05)
    return last_ms / 1000, types


async def count_tokens(redis: Redis, keys: list[str]) -> int:
    pipe = redis.pipeline(transaction=False)
    for key in keys:
        pipe.xrange(key)
    streams = await pipe.execute()
    return sum(entry_content(f).count("tok") for entries in streams for _, f in entries)


async def warm_up(env: Env, system: System, proc: Proc, tag: str) -> None:
    """A few short jobs: the worker is ready (connected, scripts loaded) when they end."""
    jobs = [(f"{tag}-warm{i}", job_body(20)) for i in range(8)]
    await system.enqueue(env, jobs, 0.0)
    await wait_terminals(env.redis, [system.key(job_id) for job_id, _ in jobs], proc, 120.0)


# --- throughput ---------------------------------------------------------------------------


@dataclass
class Throughput:
    tokens: int
    wall: float
    cpu: float
    helper_cpu: dict[str, float] = field(default_factory=dict)  # busy fraction over the round

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    @property
    def cpu_per_1k(self) -> float:
        return self.cpu / self.tokens * 1000


async def throughput_round(env: Env, system: System, proc: Proc, tag: str) -> Throughput:
    plan = env.plan
    jobs = [(f"{tag}-{i}", job_body(plan.tp_tokens)) for i in range(plan.tp_jobs)]
    keys = [system.key(job_id) for job_id, _ in jobs]
    pids = {"worker": proc.pid, **env.helpers}
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    began = time.monotonic()
    first = await system.enqueue(env, jobs, 0.0)
    last, types = await wait_terminals(env.redis, keys, proc, 300.0)
    elapsed = time.monotonic() - began
    cpu = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    tokens = await count_tokens(env.redis, keys)
    expected = plan.tp_jobs * plan.tp_tokens
    if types != Counter(done=len(jobs)) or tokens != expected:
        raise RuntimeError(f"{system.name}: {dict(types)}, {tokens} of {expected} tokens")
    helpers = {name: used / elapsed for name, used in cpu.items()}
    return Throughput(tokens, last - first, cpu["worker"], helpers)


async def throughput(env: Env, system: System) -> Throughput:
    await env.redis.flushall()
    proc = system.start(env, max(256, env.plan.tp_jobs))
    try:
        await warm_up(env, system, proc, "tp")
        rounds: list[Throughput] = []
        while len(rounds) < env.plan.tp_rounds and sum(r.wall for r in rounds) < LONG_ROUNDS:
            rounds.append(await throughput_round(env, system, proc, f"tp{len(rounds)}"))
            r = rounds[-1]
            print(
                f"  {system.label:<18} throughput round {len(rounds)}: {r.rate:9,.0f} deltas/s,"
                f" {r.cpu_per_1k:.3f} CPU s/1k deltas ({r.tokens:,} in {r.wall:.2f}s; busy:"
                f" worker {r.helper_cpu['worker']:.0%}, mock {r.helper_cpu['mock']:.0%},"
                f" redis {r.helper_cpu['redis']:.0%})",
                flush=True,
            )
        return sorted(rounds, key=lambda r: r.rate)[len(rounds) // 2]
    finally:
        proc.stop()


# --- capacity: the consumer (runs under the peer venv's interpreter) ----------------------


class Tally:
    """What one consumer process saw: latency histograms per 100 ms slot of send time."""

    def __init__(self) -> None:
        self.received: dict[int, Counter[int]] = {}  # slot -> send -> receipt buckets
        self.written: dict[int, Counter[int]] = {}  # slot -> send -> XADD (entry id, ms)
        self.sent: dict[bytes, list[float]] = {}  # stream -> [first, last] token send time
        self.tokens = 0
        self.entries = 0
        self.ends: Counter[str] = Counter()
        self.seconds: Counter[int] = Counter()  # tokens received per second (time.time())
        self.late: Counter[int] = Counter()  # of which later than LATENCY_BOUND

    def entry(self, key: bytes, entry_id: bytes, fields: dict[bytes, bytes], now: float) -> bool:
        """Count one entry; True when it ends its stream."""
        self.entries += 1
        kind = fields.get(b"type", b"")
        if kind in TERMINAL:
            self.ends[kind.decode()] += 1
            return True
        stamps = [float(stamp) for stamp in entry_content(fields).split()]
        if not stamps:
            return False
        added = int(entry_id.split(b"-", 1)[0]) / 1000  # Redis's clock when XADD ran (ms)
        late = 0
        for sent in stamps:
            slot = int(sent / SLOT)
            latency = now - sent
            late += latency > LATENCY_BOUND
            received = self.received.get(slot) or self.received.setdefault(slot, Counter())
            received[min(BUCKETS - 1, max(0, int(latency / BUCKET)))] += 1
            written = self.written.get(slot) or self.written.setdefault(slot, Counter())
            written[min(BUCKETS - 1, max(0, int((added - sent) / BUCKET)))] += 1
        span = self.sent.setdefault(key, [stamps[0], stamps[-1]])
        span[1] = stamps[-1]
        self.tokens += len(stamps)
        self.seconds[int(now)] += len(stamps)
        self.late[int(now)] += late
        return False

    def result(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "written": self.written,
            "sent": list(self.sent.values()),
            "tokens": self.tokens,
            "entries": self.entries,
            "ends": self.ends,
            "seconds": self.seconds,
            "late": self.late,
        }


async def read_streams(redis: Redis, keys: list[bytes], tally: Tally, deadline: float) -> None:
    cursors = dict.fromkeys(keys, b"0-0")
    while cursors and time.time() < deadline:
        reply: Any = await redis.xread(cursors, block=200)  # type: ignore[arg-type]
        now = time.time()
        for key, entries in reply.items() if isinstance(reply, dict) else reply:
            for entry_id, fields in entries:
                cursors[key] = entry_id
                if tally.entry(key, entry_id, fields, now):
                    del cursors[key]
                    break


async def consume(spec: dict[str, Any]) -> dict[str, Any]:
    redis = Redis.from_url(spec["redis"])
    keys = [key.encode() for key in spec["keys"]]
    per = spec["keys_per_read"]
    tally = Tally()
    began, usage = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    tasks = [
        asyncio.create_task(read_streams(redis, keys[at : at + per], tally, spec["deadline"]))
        for at in range(0, len(keys), per)
    ]
    await asyncio.sleep(0.3)  # the readers are blocked in XREAD before the jobs come
    print("ready", flush=True)
    await asyncio.gather(*tasks)
    end = resource.getrusage(resource.RUSAGE_SELF)
    await redis.aclose()
    cpu = end.ru_utime + end.ru_stime - usage.ru_utime - usage.ru_stime
    return {**tally.result(), "cpu": cpu / (time.monotonic() - began)}


def consumer_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = asyncio.run(consume(spec))
    Path(spec["out"]).write_text(json.dumps(result))


# --- capacity: the orchestration ----------------------------------------------------------


@dataclass
class Step:
    streams: int
    p50: float = math.nan
    p99: float = math.nan
    p99_written: float = math.nan  # send -> XADD only (the worker's part)
    worst: float = math.nan
    p99_all: float = math.nan  # every token, ramp-up and wind-down included
    window: tuple[float, float] = (0.0, 0.0)  # send times between which all N streams sent
    tokens: int = 0
    expected: int = 0
    done: int = 0
    worker_cpu: float = 0.0  # busy fraction of one core over the step
    worker_cpu_s: float = 0.0  # seconds
    consumer_cpu: float = 0.0
    helper_cpu: dict[str, float] = field(default_factory=dict)
    machine: float = 0.0
    background: float = 0.0
    loadavg: float = 0.0  # the 1-minute load average before the step (all processes)
    others: float = 0.0  # busy fraction of the machine during the step, not ours
    wakeups: int = 0  # the worker's voluntary context switches over the step
    timeline: list[str] = field(default_factory=list)  # "late/received" tokens per second
    rss: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def cpu_per_token(self) -> float:
        """Worker CPU seconds per token delivered (ramp and wind-down included)."""
        return self.worker_cpu_s / self.tokens if self.tokens else math.nan

    @property
    def busy(self) -> bool:
        """Other processes used more than BUSY of the machine in the second before the step
        or during it (the machine's CPU less that of the benchmark's own processes)."""
        return self.background > BUSY or self.others > BUSY


def percentile(hist: dict[int, int], q: float) -> float:
    """The upper edge of the bucket holding the q-quantile, in seconds."""
    total = sum(hist.values())
    seen = 0
    for bucket in sorted(hist):
        seen += hist[bucket]
        if seen >= q * total:
            return (bucket + 1) * BUCKET
    return math.nan


Consumer = tuple[asyncio.subprocess.Process, Path]


async def start_consumers(env: Env, keys: list[str], deadline: float) -> list[Consumer]:
    """Consumer processes over slices of ``keys``; returns once all are reading."""
    plan, consumers = env.plan, []
    for i in range(plan.consumers):
        out, spec = env.logs / f"consumer{i}.json", env.logs / f"consumer{i}-spec.json"
        out.unlink(missing_ok=True)
        spec.write_text(
            json.dumps({"redis": env.redis_url, "keys": keys[i :: plan.consumers],
                        "deadline": deadline, "keys_per_read": plan.keys_per_read,
                        "out": str(out)})
        )  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            str(PEER_PYTHON), __file__, "--consume", str(spec), stdout=subprocess.PIPE
        )
        consumers.append((proc, out))
        assert proc.stdout is not None
        if (await proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError("a consumer did not start")
    return consumers


async def wait_consumers(consumers: list[Consumer]) -> list[dict[str, Any]]:
    codes = await asyncio.gather(*(proc.wait() for proc, _ in consumers))
    if any(codes):
        raise RuntimeError(f"consumer exit codes {codes}")
    return [json.loads(out.read_text()) for _, out in consumers]


def merged(results: list[dict[str, Any]], name: str) -> dict[int, Counter[int]]:
    slots: dict[int, Counter[int]] = {}
    for result in results:
        for slot, hist in result[name].items():
            slots.setdefault(int(slot), Counter()).update({int(k): v for k, v in hist.items()})
    return slots


def within(slots: dict[int, Counter[int]], start: float, end: float) -> Counter[int]:
    """The histogram of the tokens sent between ``start`` and ``end`` (whole slots)."""
    total: Counter[int] = Counter()
    for slot, hist in slots.items():
        if start <= slot * SLOT and (slot + 1) * SLOT <= end:
            total.update(hist)
    return total


def summarize(step: Step, results: list[dict[str, Any]], duration: float) -> None:
    received, written = merged(results, "received"), merged(results, "written")
    spans = [span for result in results for span in result["sent"]]
    ends, seconds, late = Counter[str](), Counter[int](), Counter[int]()
    for result in results:
        ends.update(result["ends"])
        seconds.update({int(k): v for k, v in result["seconds"].items()})
        late.update({int(k): v for k, v in result["late"].items()})
        step.tokens += result["tokens"]
        step.consumer_cpu += result["cpu"]
    everything = within(received, -math.inf, math.inf)
    step.p99_all = percentile(everything, 0.99)
    if len(spans) == step.streams:  # the window in which all N streams were sending
        step.window = (max(a for a, _ in spans), min(b for _, b in spans))
    steady = within(received, *step.window)
    step.p50, step.p99 = percentile(steady, 0.50), percentile(steady, 0.99)
    step.worst = (max(steady) + 1) * BUCKET if steady else math.nan
    step.p99_written = percentile(within(written, *step.window), 0.99)
    step.timeline = [f"{late[t]}/{seconds[t]}" for t in sorted(seconds)]
    step.done = ends["done"]
    judge(step, ends, duration)


def judge(step: Step, ends: Counter[str], duration: float) -> None:
    if step.done != step.streams:
        step.problems.append(f"{step.done}/{step.streams} streams done {dict(ends)}")
    if step.tokens != step.expected:
        step.problems.append(f"{step.tokens}/{step.expected} tokens")
    if step.window[1] - step.window[0] < duration / 2:
        step.problems.append(
            f"all {step.streams} streams sent together for only"
            f" {max(0.0, step.window[1] - step.window[0]):.1f}s"
        )
    if not step.p99 <= LATENCY_BOUND:
        step.problems.append(f"p99 {step.p99 * 1000:.1f} ms")


async def measure_streams(env: Env, system: System, proc: Proc, n: int) -> Step:
    plan = env.plan
    tokens = round(plan.rate * plan.duration)
    mock = {"rate": plan.rate, "tick": env.tick, "timestamps": True}
    jobs = [(f"s{n}-{i}", job_body(tokens, **mock)) for i in range(n)]
    deadline = time.time() + plan.ramp + plan.duration + max(5.0, plan.duration) + 2
    consumers = await start_consumers(env, [system.key(job_id) for job_id, _ in jobs], deadline)
    step = Step(n, expected=n * tokens)
    pids = {"worker": proc.pid, **env.helpers}
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    wakeups_before, own_before = voluntary_switches(proc.pid), own_cpu_seconds()
    busy_before, began = machine_busy(), time.monotonic()
    try:
        await system.enqueue(env, jobs, plan.ramp)
        results = await wait_consumers(consumers)
    finally:
        for consumer, _ in consumers:
            if consumer.returncode is None:
                consumer.kill()
    elapsed = time.monotonic() - began
    proc.check()
    used = {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    cpu = {name: seconds / elapsed for name, seconds in used.items()}
    step.worker_cpu, step.worker_cpu_s = cpu.pop("worker"), used["worker"]
    step.wakeups = voluntary_switches(proc.pid) - wakeups_before
    step.helper_cpu = cpu
    busy_after = machine_busy()
    step.machine = (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
    ours = sum(used.values()) + own_cpu_seconds() - own_before
    step.others = max(0.0, (busy_after[0] - busy_before[0]) / CLOCK_TICK - ours) / elapsed / CPUS
    step.rss = peak_rss(proc.pid)
    summarize(step, results, plan.duration)
    return step


STEP_HEADER = (
    f"  {'':<18} {'':>7} {'latency ms, all N sending':^27} {'(all)':>6}"
    f" {'CPU, one core = 100%':^30} {'':>6} {'':>6} {'load':>5} {'peak':>5} {'us CPU':>6}"
    f" {'wakes':>6}\n"
    f"  {'':<18} {'streams':>7} {'p50':>6} {'p99':>6} {'max':>6} {'XADD':>6} {'p99':>6}"
    f" {'worker':>6} {'cons.':>5} {'mock':>5} {'redis':>5} {'all':>5} {'before':>6} {'others':>6}"
    f" {'1min':>5}"
    f" {'RSS':>5} {'/token':>6} {'/token':>6}"
)


def step_line(system: System, step: Step) -> str:
    verdict = "ok" if step.ok else "FAIL: " + "; ".join(step.problems)
    verdict += " (BUSY machine: not for ratios)" if step.busy else ""
    cpu, ms = step.helper_cpu, 1000
    wakes = step.wakeups / step.tokens if step.tokens else math.nan
    return (
        f"  {system.label:<18} {step.streams:>7} {step.p50 * ms:>6.1f} {step.p99 * ms:>6.1f}"
        f" {step.worst * ms:>6.0f} {step.p99_written * ms:>6.0f} {step.p99_all * ms:>6.0f}"
        f" {step.worker_cpu:>6.0%} {step.consumer_cpu:>5.0%} {cpu['mock']:>5.0%}"
        f" {cpu['redis']:>5.0%} {step.machine * CPUS:>5.0%} {step.background * CPUS:>6.0%}"
        f" {step.others * CPUS:>6.0%} {step.loadavg:>5.2f} {step.rss / 2**20:>4.0f}M"
        f" {step.cpu_per_token * 1e6:>6.0f} {wakes:>6.2f}  {verdict}"
    )


async def wait_for_quiet(env: Env) -> float:
    """Wait (within the run's budget) until other processes leave the CPUs mostly idle."""
    load = await asyncio.to_thread(machine_load, 1.0)
    while load > QUIET and env.quiet_budget > 0:
        env.quiet_budget -= 1.0
        load = await asyncio.to_thread(machine_load, 1.0)
    return load


async def capacity_step(env: Env, system: System, n: int) -> Step:
    await env.redis.flushall()
    background = await wait_for_quiet(env)
    loadavg = os.getloadavg()[0]
    proc = system.start(env, n)
    try:
        await warm_up(env, system, proc, f"c{n}")
        step = await measure_streams(env, system, proc, n)
    finally:
        proc.stop()
    step.background, step.loadavg = background, loadavg
    print(step_line(system, step), flush=True)
    if env.plan.verbose:
        print("      tokens late/received, per second: " + " ".join(step.timeline), flush=True)
    return step


@dataclass
class Capacity:
    """One system's capacity search: the largest passing step and the first failing one
    above it (the bisection's ends), every step run, and the fixed light-load step."""

    best: Step | None = None
    fail: Step | None = None
    steps: list[Step] = field(default_factory=list)
    light: Step | None = None

    @property
    def busy(self) -> bool:
        """The machine was busy before a step that decides the capacity."""
        return any(step is not None and step.busy for step in (self.best, self.fail))


async def capacity(env: Env, system: System) -> Capacity:
    """The light-load step, then: double N until a step fails (halve while the first
    fails), then bisect until the two ends are within RESOLUTION (``refine`` steps at most)."""
    plan = env.plan
    found = Capacity()
    print(STEP_HEADER, flush=True)
    if plan.light and not plan.steps:
        found.light = await capacity_step(env, system, plan.light)
        found.steps.append(found.light)
    if plan.steps:
        found.steps = [await capacity_step(env, system, n) for n in plan.steps]
        found.best = max((s for s in found.steps if s.ok), key=lambda s: s.streams, default=None)
        return found
    await _bracket(env, system, found)
    for _ in range(plan.refine):
        if found.best is None or found.fail is None:
            break
        low, high = found.best.streams, found.fail.streams
        mid = nice((low + high) // 2)
        if high - low <= max(grain(low), RESOLUTION * low) or mid in (low, high):
            break
        found.steps.append(await capacity_step(env, system, mid))
        if found.steps[-1].ok:
            found.best = found.steps[-1]
        else:
            found.fail = found.steps[-1]
    return found


async def _bracket(env: Env, system: System, found: Capacity) -> None:
    """Double N from the start until a step fails, halving while the first ones fail."""
    plan = env.plan
    n = plan.start_ours if system.name == "ours" else plan.start_peer
    while 1 <= n <= plan.max_streams:
        step = await capacity_step(env, system, n)
        found.steps.append(step)
        if step.ok:
            found.best, n = step, n * 2
        else:
            found.fail, n = step, n // 2
        if found.best is not None and found.fail is not None:
            return


def grain(n: int) -> int:
    return 25 if n >= 200 else 5 if n >= 20 else 1


def nice(n: int) -> int:
    return n // grain(n) * grain(n)


# --- the report ---------------------------------------------------------------------------


# --- memory: RSS per in-flight stream -------------------------------------------------------


@dataclass
class Memory:
    streams: int
    base: int  # VmRSS after the warm-up, bytes
    peak: int  # VmHWM once every stream ended

    @property
    def per_stream(self) -> float:
        return (self.peak - self.base) / self.streams


def current_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def memory(env: Env, system: System) -> Memory:
    """``memory_streams`` slow streams in flight at once; (peak - base RSS) per stream."""
    plan = env.plan
    await env.redis.flushall()
    proc = system.start(env, plan.memory_streams)
    try:
        await warm_up(env, system, proc, "m")
        base = current_rss(proc.pid)
        body = job_body(round(plan.memory_rate * plan.duration), rate=plan.memory_rate)
        jobs = [(f"m-{i}", body) for i in range(plan.memory_streams)]
        await system.enqueue(env, jobs, plan.ramp)
        keys = [system.key(job_id) for job_id, _ in jobs]
        _, types = await wait_terminals(env.redis, keys, proc, plan.duration * 4 + 60)
        if types != Counter(done=len(jobs)):
            raise RuntimeError(f"{system.name}: memory phase ended {dict(types)}")
        result = Memory(plan.memory_streams, base, peak_rss(proc.pid))
    finally:
        proc.stop()
    print(
        f"  {system.label:<18} memory: {result.streams} streams in flight, RSS"
        f" {result.base / 2**20:.0f} -> {result.peak / 2**20:.0f} MiB,"
        f" {result.per_stream / 1024:.1f} KiB per stream",
        flush=True,
    )
    return result


# --- the report ---------------------------------------------------------------------------


def report(results: dict[str, dict[str, Any]], plan: Plan, quick: bool) -> None:
    ours, peer = results.get("ours", {}), results.get("peer", {})
    rows = _throughput_rows(ours.get("throughput"), peer.get("throughput"))
    for phase, label, target in (
        ("capacity", "plain HTTP", 8),
        ("tls", "TLS", 6),
        ("coalesced", f"coalescing mock (tick {plan.coalesced_tick:g}s)", 0),
    ):
        if phase in ours or phase in peer:
            rows += _capacity_rows(ours.get(phase), peer.get(phase), plan, label, target)
    rows += _memory_rows(ours.get("memory"), peer.get("memory"))
    if quick:  # too small to judge the targets
        rows = [(*row[:5], "(smoke run)" if row[4] else row[5]) for row in rows]
    print()
    print(
        f"throughput: {plan.tp_jobs} jobs x {plan.tp_tokens} tokens, upstream unpaced, one worker"
        f" process; capacity: streams of {plan.rate:g} tokens/s x {plan.duration:g}s, one event"
        f" per upstream write, p99 of send->XREAD receipt <= {LATENCY_BOUND * 1000:g} ms"
    )
    header = f"{'':<34}{'chatstream':>12}{'arq + openai':>14}{'ratio':>8}{'target':>9}  verdict"
    print(header)
    print("-" * len(header))
    for name, x, y, r, goal, verdict in rows:
        print(f"{name:<34}{x:>12}{y:>14}{r:>8}{goal:>9}  {verdict}")
    if "runtime" in ours:
        print(f"chatstream's worker ran on: {ours['runtime']} (its start-up line)")
    if "cluster" in ours:
        from cluster_phase import cluster_table

        print("\n" + "\n".join(cluster_table(ours["cluster"])))
    if quick:
        print(f"(--quick: small sizes, capacity capped at {plan.max_streams} streams: a smoke run)")


Row = tuple[str, str, str, str, str, str]


def _ratio(a: float | None, b: float | None, target: float) -> tuple[str, str]:
    if not a or not b or math.isnan(a) or math.isnan(b):
        return "", ""
    return f"{a / b:.1f}x", ("met" if a / b >= target else "MISSED") if target else ""


def _throughput_rows(a: Throughput | None, b: Throughput | None) -> list[Row]:
    if a is None and b is None:
        return []
    rate = _ratio(a.rate if a else None, b.rate if b else None, 25)
    cpu = _ratio(b.cpu_per_1k if b else None, a.cpu_per_1k if a else None, 0)
    return [
        ("throughput: deltas/s", f"{a.rate:,.0f}" if a else "-", f"{b.rate:,.0f}" if b else "-",
         rate[0], ">= 25x", rate[1]),
        ("  CPU s per 1k deltas", f"{a.cpu_per_1k:.4f}" if a else "-",
         f"{b.cpu_per_1k:.4f}" if b else "-", cpu[0], "", "(peer / ours)"),
    ]  # fmt: skip


def _capacity_rows(
    ours: Capacity | None, peer: Capacity | None, plan: Plan, label: str, target: float
) -> list[Row]:
    a, b = (ours.best if ours else None), (peer.best if peer else None)

    def streams(step: Step | None) -> str:
        if step is None:
            return "0"
        return f"{'>=' if step.streams * 2 > plan.max_streams else ''}{step.streams:,}"

    n = _ratio(a.streams if a else None, b.streams if b else None, target)
    if a is not None and a.streams * 2 > plan.max_streams:
        n = (f">={n[0]}", "lower bound (--max-streams)") if n[0] else n
    if n[0] and any(c is not None and c.busy for c in (ours, peer)):
        n = (f"({n[0]})", "not judged: machine busy before a deciding step")
    us = _ratio(b.cpu_per_token if b else None, a.cpu_per_token if a else None, 8 if target else 0)
    rows = [
        (f"{label}: streams at p99 <= 50ms", streams(a), streams(b), n[0],
         f">= {target:g}x" if target else "", n[1]),
        ("  between (passed..failed)", _between(ours), _between(peer), "", "", ""),
        ("  p99 there (ms)", _ms(a), _ms(b), "", "", ""),
        ("  XADD p99 there (ms)", _xadd(a), _xadd(b), "", "<= p99/2", _half(a)),
        ("  worker CPU per token there (us)", _us(a), _us(b), us[0],
         ">= 8x" if target else "", us[1] + (" (peer / ours)" if us[1] else "")),
        ("  worker busy there (one core)", _busy(a), _busy(b), "", "", ""),
        ("  peak RSS there (MiB)", _mib(a), _mib(b), "", "", ""),
    ]  # fmt: skip
    if target and a is not None:
        rows.append(
            ("  ours <= 25 us CPU per token there", _us(a), "", "", "<= 25", _at_most(a, 25))
        )
    return rows + _light_rows(ours, peer, plan, bool(target))


def _light_rows(ours: Capacity | None, peer: Capacity | None, plan: Plan, judge: bool) -> list[Row]:
    """The fixed light-load step, and the CPU per token of every step from it up."""
    a, b = (ours.light if ours else None), (peer.light if peer else None)
    if a is None and b is None:
        return []
    us = _ratio(b.cpu_per_token if b else None, a.cpu_per_token if a else None, 0)
    rows = [
        (f"  at {plan.light} streams: CPU per token (us)", _us(a), _us(b), us[0],
         "<= 40" if judge else "", _at_most(a, 40) if judge else ""),
        (f"  at {plan.light} streams: p99 (ms)", _ms(a), _ms(b), "", "", ""),
    ]  # fmt: skip
    if judge and ours is not None:
        every = [s for s in ours.steps if s.streams >= plan.light and s.ok]
        worst = max(every, key=lambda s: s.cpu_per_token, default=None)
        rows.append(
            (f"  ours, worst passing step >= {plan.light}", _us(worst), "", "", "<= 40",
             _at_most(worst, 40) + (f" ({worst.streams} streams)" if worst else ""))
        )  # fmt: skip
    return rows


def _between(found: Capacity | None) -> str:
    if found is None or found.best is None:
        return "-"
    return f"{found.best.streams}..{found.fail.streams if found.fail else '?'}"


def _at_most(step: Step | None, bound: float) -> str:
    if step is None:
        return ""
    verdict = "met" if step.cpu_per_token * 1e6 <= bound else "MISSED"
    return verdict + (" (busy)" if step.busy else "")


def _xadd(step: Step | None) -> str:
    return f"{step.p99_written * 1000:.1f}" if step else "-"


def _half(step: Step | None) -> str:
    if step is None or math.isnan(step.p99_written):
        return ""
    return "met" if step.p99_written <= step.p99 / 2 else "MISSED"


def _memory_rows(a: Memory | None, b: Memory | None) -> list[Row]:
    if a is None and b is None:
        return []
    streams = (a or b).streams  # type: ignore[union-attr]

    def kib(m: Memory | None) -> str:
        return f"{m.per_stream / 1024:.1f}" if m else "-"

    ok = "" if a is None else ("met" if a.per_stream <= 64 * 1024 else "MISSED")
    return [(f"RSS per in-flight stream, {streams:,} (KiB)", kib(a), kib(b), "", "<= 64", ok)]


def _ms(step: Step | None) -> str:
    return f"{step.p99 * 1000:.1f}" if step else "-"


def _us(step: Step | None) -> str:
    return f"{step.cpu_per_token * 1e6:.0f}" if step else "-"


def _busy(step: Step | None) -> str:
    return f"{step.worker_cpu:.0%}" if step else "-"


def _mib(step: Step | None) -> str:
    return f"{step.rss / 2**20:.0f}" if step else "-"


# --- main ---------------------------------------------------------------------------------


async def run(plan: Plan, systems: list[System], logs: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {s.name: {} for s in systems}
    tls = make_certificate(logs)
    with (
        redis_server(logs) as (redis_url, redis_pid),
        mock_upstream(logs) as (mock_url, mock_pid),
        mock_upstream(logs, tls) as (tls_url, tls_pid),
    ):
        redis = Redis.from_url(redis_url)
        env = Env(plan, redis_url, mock_url, logs, redis, {"mock": mock_pid, "redis": redis_pid})
        env.quiet_budget = plan.quiet_budget
        over_tls = Env(plan, redis_url, tls_url, logs, redis, {"mock": tls_pid, "redis": redis_pid})
        over_tls.ca_file = str(tls[0])
        try:
            await run_phases(plan, systems, env, over_tls, results)
        finally:
            await redis.aclose()
    if "ours" in results:
        results["ours"]["runtime"] = worker_runtime(logs / "ours-worker.log")
    return results


RUNTIME_KEYS = ("event_loop", "redis_parser", "http_transport")


def worker_runtime(log_path: Path) -> str:
    """What chatstream's worker ran on, from its start-up line (the last one logged)."""
    if not log_path.exists():
        return "unknown"
    lines = [x for x in log_path.read_text(errors="replace").splitlines() if " started: " in x]
    if not lines:
        return "unknown"
    words = lines[-1].replace('"', " ").split()
    found = [w for w in words if w.split("=", 1)[0] in RUNTIME_KEYS]
    return " ".join(found) or "unknown"


async def run_phases(
    plan: Plan, systems: list[System], env: Env, over_tls: Env, results: dict[str, dict[str, Any]]
) -> None:
    for system in systems if "throughput" in plan.phases else []:
        results[system.name]["throughput"] = await throughput(env, system)
    for phase in ("capacity", "tls", "coalesced"):
        if phase not in plan.phases:
            continue
        phase_env = over_tls if phase == "tls" else env
        phase_env.tick = plan.coalesced_tick if phase == "coalesced" else plan.tick
        for system in systems:
            print(f"{phase}: {system.label}", flush=True)
            over_tls.quiet_budget = env.quiet_budget
            found = await capacity(phase_env, system)
            env.quiet_budget = phase_env.quiet_budget
            results[system.name][phase] = found
    for system in systems if "memory" in plan.phases else []:
        results[system.name]["memory"] = await memory(env, system)
    if "cluster" in plan.phases and any(system.name == "ours" for system in systems):
        from cluster_phase import cluster_phase

        print("cluster: chatstream on one server and on a 3-master cluster", flush=True)
        results["ours"]["cluster"] = await cluster_phase(env, spawn, redis_server)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, Plan]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--only", choices=["ours", "peer"], help="run one system only")
    parser.add_argument(
        "--phase",
        help="comma-separated phases: throughput, capacity, tls, memory, cluster (default: all"
        " five), coalesced (extra: capacity with a coalescing mock)",
    )
    parser.add_argument("--duration", type=float, help="seconds of streaming per step")
    parser.add_argument("--rate", type=float, help="tokens/s per stream in the capacity steps")
    parser.add_argument("--start", type=int, help="first capacity step (both systems)")
    parser.add_argument("--max-streams", type=int, help="largest capacity step to try")
    parser.add_argument("--steps", help="comma-separated capacity steps to run (no search)")
    parser.add_argument("--consumers", type=int, help="consumer processes")
    parser.add_argument("--chatstream", help="the chatstream executable to run (A/B builds)")
    parser.add_argument(
        "--nice", type=int, default=0, help="niceness for this run and all it starts (inherited)"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs directory")
    parser.add_argument("--verbose", action="store_true", help="per-second late tokens per step")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    overrides = _overrides(args)
    unknown = set(overrides.get("phases", ())) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}")
    return args, Plan(**{**plan.__dict__, **overrides})


PHASES = ("throughput", "capacity", "tls", "memory", "coalesced", "cluster")
SIMPLE_OPTIONS = ("duration", "rate", "consumers", "verbose", "max_streams", "chatstream")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The Plan fields the command line sets."""
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in SIMPLE_OPTIONS if getattr(args, name)
    }
    if args.start:
        overrides["start_ours"] = overrides["start_peer"] = args.start
    if args.steps:
        overrides["steps"] = tuple(int(n) for n in args.steps.split(","))
    if args.phase:
        overrides["phases"] = tuple(args.phase.split(","))
    return overrides


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--consume"]:
        consumer_main(argv[1])
        return
    args, plan = parse_args(argv)
    if args.nice:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by every process started
        set_autogroup_nice(os.getpid())  # this session: the consumers
    ensure_peer_venv()
    systems: list[System] = [s for s in (Ours(), Peer()) if args.only in (None, s.name)]
    logs = Path(tempfile.mkdtemp(prefix="bench-worker-"))
    background = machine_load()
    print(
        f"machine: {os.cpu_count()} CPUs, {background:.0%} busy before the run, 1-minute load"
        f" {os.getloadavg()[0]:.2f}; a step is BUSY (no ratio from it) when other processes"
        f" used more than {BUSY:.0%} of the machine in the second before it",
        flush=True,
    )
    if background > 0.1:
        print("warning: other processes are using the CPU; the figures will be lower", flush=True)
    began = time.monotonic()
    try:
        results = asyncio.run(run(plan, systems, logs))
    except BaseException:
        print(f"logs kept in {logs}", file=sys.stderr)
        raise
    report(results, plan, args.quick)
    print(f"\n({time.monotonic() - began:.0f}s; logs: {logs if args.keep_logs else 'removed'})")
    if not args.keep_logs:
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
