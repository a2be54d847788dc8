"""The dashboard at scale: page load times and the Redis commands it costs with open pages.

A redis-server of its own (a free loopback port, no persistence) holds a fleet's state
written here: ``--jobs`` jobs in the jobs index (records of ended jobs over the last 23
hours: 90% succeeded, 7% failed, 3% cancelled), ``--tenants`` tenants with 5 jobs each
waiting in their queues (1 high, 3 normal, 1 low), 200 jobs running (delivered to eight
consumers), 500 dead letters, eight workers' heartbeats and reports, and a day of
per-minute activity counters (60 tenants a minute). No worker runs: what Redis does is
the dashboard's.

``chatstream dashboard`` runs as a process of its own. Measured:

api
    each endpoint's answer time over HTTP (median and max of ``--repeat``), the overview
    cold (its first read: a day of charts and every record of the dead letters' tenants)
    and warm.
pages
    in Debian's Chromium (Playwright, one new tab each time): from navigation until the
    view shows its data (the overview's waiting count, the jobs of a tenant, a job's
    record, the dead letters' rows, the upstream and worker rows); median and max.
redis
    with 0, 1 and 10 tabs open on the overview: Redis's CPU in the commands it ran (``INFO
    commandstats`` usec, less ``INFO``) and the dashboard process's CPU over ``--seconds``;
    then, for up to 10 s, the commands per second the dashboard sent and those its
    scripts ran (``MONITOR``, which marks a script's commands).

Run: ``.venv/bin/python bench/bench_dashboard.py [--jobs 100000] [--tenants 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from bench_fleet import free_port
from playwright.async_api import Browser, Page, async_playwright, expect
from redis.asyncio import Redis
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.client import Client
from worker.settings import Settings
from worker.store.activity import ActivityLog, minute_of
from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.queue import Queue
from worker.store.scheduler import config_fields

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "dash"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--disable-background-networking", "--no-first-run"]  # fmt: skip
REQUEST = {"model": "m", "messages": [{"role": "user", "content": "a short question"}]}
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def settings_for(url: str) -> Settings:
    return Settings(
        _env_file=None,
        redis_url=url,
        prefix=PREFIX,
        upstream_max_concurrent=500,
        upstream_requests_per_minute=100_000,
        upstream_tokens_per_minute=100_000_000,
    )


# -- the fleet's state ------------------------------------------------------------------------


async def fill(redis: Redis, settings: Settings, jobs: int, tenants: int) -> dict[str, Any]:
    keys = Keys(settings.prefix)
    reader = Queue(redis, keys, "bench-reader")
    await reader.ensure_group()
    await reader.scheduler.publish(config_fields(settings))
    ended = await _ended_jobs(redis, keys, jobs, tenants)
    client = Client.from_settings(settings, redis)
    for index in range(tenants):
        tenant = f"t{index:04d}"
        await client.enqueue_many([REQUEST], tenant=tenant, priority="high")
        await client.enqueue_many([REQUEST] * 3, tenant=tenant)
        await client.enqueue_many([REQUEST], tenant=tenant, priority="low")
    for worker in range(8):
        await Queue(redis, keys, f"bench-w{worker}").read(25, None)  # 200 running
    failed = [job_id for job_id, status in ended if status == "failed"]
    for job_id in failed[:500]:
        reason = json.dumps({"code": "attempts_exhausted", "attempts": 3})
        await redis.xadd(keys.dead, {"job": job_id, "reason": reason})
    await _workers(redis, keys)
    await _activity(redis, keys, tenants)
    return {"job": ended[-1][0], "tenant": f"t{tenants // 2:04d}", "failed": failed[0]}


async def _ended_jobs(redis: Redis, keys: Keys, jobs: int, tenants: int) -> list[tuple[str, str]]:
    """``jobs`` records of ended jobs, indexed; (id, status) of each."""
    now, ended = time.time(), []
    rng = random.Random(38)
    for start in range(0, jobs, 2_000):
        pipe = redis.pipeline(transaction=False)
        for n in range(start, min(start + 2_000, jobs)):
            job_id, created = f"job-{n:07d}", now - 82_800 + 82_800 * n / jobs
            status = rng.choices(["succeeded", "failed", "cancelled"], [90, 7, 3])[0]
            fields = {"id": job_id, "status": status, "tenant": f"t{n % tenants:04d}",
                      "upstream": "default", "priority": "normal", "attempt": "1",
                      "created_at": f"{created:.6f}", "started_at": f"{created + 0.1:.6f}",
                      "finished_at": f"{created + 5:.6f}", "model": "m",
                      "request": json.dumps(REQUEST)}  # fmt: skip
            if status == "failed":
                fields["error"] = json.dumps({"code": "upstream", "message": "HTTP 500"})
            pipe.hset(keys.job(job_id), mapping=fields)  # type: ignore[arg-type]
            pipe.zadd(keys.jobs, {job_id: created})
            ended.append((job_id, status))
        await pipe.execute()
    return ended


async def _workers(redis: Redis, keys: Keys) -> None:
    for n in range(8):
        report = {"version": "0.1.0", "host": f"box{n}", "pid": 100 + n, "started": time.time(),
                  "slots": 64, "busy": 25, "waiting": 0, "processed": 9000, "down": {}}  # fmt: skip
        await Liveness(redis, keys, f"bench-w{n}", 3).beat(json.dumps(report))


async def _activity(redis: Redis, keys: Keys, tenants: int) -> None:
    log, now = ActivityLog(redis, keys), minute_of(time.time())
    rng = random.Random(1)
    for minute in range(now - 1439, now + 1):
        counts = {"n:succeeded": rng.randint(50, 90), "n:failed": rng.randint(0, 6),
                  "tok": rng.randint(20_000, 40_000), "ttft:4": 40, "ttft:6": 10,
                  "f:upstream": 2, "u:default:n": 80}  # fmt: skip
        for tenant in rng.sample(range(tenants), 60):
            counts[f"t:t{tenant:04d}:n"] = rng.randint(1, 3)
        await log.add(minute, counts)


# -- measuring --------------------------------------------------------------------------------


def stats(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:8.1f} ms median {max(samples) * 1000:8.1f} max"


async def timed(work: Callable[[], Awaitable[Any]], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        began = time.perf_counter()
        await work()
        samples.append(time.perf_counter() - began)
    return samples


async def api_times(url: str, marks: dict[str, Any], repeat: int) -> list[str]:
    lines = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        cold = await timed(lambda: http.get("/api/overview"), 1)
        lines.append(f"  /api/overview, cold (first read)       {stats(cold)}")
        await asyncio.sleep(1.2)  # past the cached read's interval
        paths = ["/api/overview", "/api/jobs", f"/api/jobs?tenant={marks['tenant']}",
                 "/api/jobs?status=failed", f"/api/jobs/{marks['job']}", "/api/dead",
                 "/api/tenants?q=t05", "/api/activity?minutes=1440"]  # fmt: skip
        for path in paths:

            async def get(path: str = path) -> None:
                response = await http.get(path)
                assert response.status_code == 200, (path, response.text[:200])
                await asyncio.sleep(1.05 if path == "/api/overview" else 0)

            samples = await timed(get, repeat)
            if path == "/api/overview":
                samples = [s - 1.05 for s in samples]
            lines.append(f"  {path:<40} {stats(samples)}")
    return lines


VIEWS = {
    "overview": ("/", "#total-waiting", "text"),
    "jobs of a tenant": ("/#/jobs?tenant={tenant}", "#jobs tbody tr[data-job]", "rows"),
    "a job": ("/#/job/{job}", "#job-record tr[data-field]", "rows"),
    "dead letters": ("/#/dead", "#dead tbody tr[data-entry]", "rows"),
    "upstreams": ("/#/upstreams", "#upstreams tbody tr[data-upstream]", "rows"),
    "workers": ("/#/workers", "#workers tbody tr[data-worker]", "rows"),
}


async def page_times(browser: Browser, url: str, marks: dict[str, Any], repeat: int) -> list[str]:
    lines = []
    for name, (path, selector, kind) in VIEWS.items():
        samples = []
        for _ in range(repeat):
            page = await browser.new_page()
            began = time.perf_counter()
            await page.goto(url + path.format(**marks))
            if kind == "text":
                await expect(page.locator(selector)).not_to_have_text("", timeout=30_000)
            else:
                await page.locator(selector).first.wait_for(timeout=30_000)
            samples.append(time.perf_counter() - began)
            await page.close()
        lines.append(f"  {name:<40} {stats(samples)}")
    return lines


async def redis_load(
    redis: Redis, browser: Browser, url: str, pid: int, tabs: int, seconds: float
) -> str:
    pages: list[Page] = []
    for _ in range(tabs):
        page = await browser.new_page()
        await page.goto(url + "/")
        pages.append(page)
    await asyncio.sleep(3)  # the loop is running (or has stopped, with no tab)
    before = await _counters(redis, pid)
    await asyncio.sleep(seconds)
    after = await _counters(redis, pid)
    sent, in_scripts = await _monitored(redis, min(seconds, 10.0))
    for page in pages:
        await page.close()
    usec = (after[0] - before[0]) / seconds
    cpu = (after[1] - before[1]) / seconds
    runs, script_usec = after[2] - before[2], after[3] - before[3]
    script = f"{runs} script runs, {script_usec / runs / 1000:.1f} ms each" if runs else "no script"
    return (f"  {tabs:>2} tabs: {sent:6.1f} commands/s sent, {in_scripts:6.1f}/s more run by "
            f"its scripts; Redis {usec / 1000:5.2f} ms CPU/s in them ({script}); dashboard "
            f"process {cpu * 100:4.1f}% of a core")  # fmt: skip


async def _monitored(redis: Redis, seconds: float) -> tuple[float, float]:
    """Commands per second the dashboard sent, and those its scripts ran (``MONITOR``)."""
    sent = in_scripts = 0
    async with redis.monitor() as monitor:
        with contextlib.suppress(TimeoutError, RedisTimeoutError):  # (the latter: no command)
            async with asyncio.timeout(seconds):
                async for command in monitor.listen():
                    if command.get("client_type") == "lua":
                        in_scripts += 1
                    else:
                        sent += 1
    return sent / seconds, in_scripts / seconds


async def _counters(redis: Redis, pid: int) -> tuple[int, float, int, int]:
    """Redis's usec in every command but INFO, the dashboard's CPU seconds, and the calls
    and usec of EVALSHA (the dashboard's only script: the waiting jobs by priority)."""
    info: Any = await redis.info("commandstats")
    usec = sum(int(v["usec"]) for k, v in info.items() if k != "cmdstat_info")
    script = info.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return usec, process_cpu(pid), int(script["calls"]), int(script["usec"])


def process_cpu(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


# -- the run ----------------------------------------------------------------------------------


async def run(url: str, args: argparse.Namespace) -> None:
    redis = Redis.from_url(url, decode_responses=True)
    settings = settings_for(url)
    began = time.perf_counter()
    marks = await fill(redis, settings, args.jobs, args.tenants)
    indexed, keys = await redis.zcard(settings.prefix + ":jobs"), await redis.dbsize()
    print(f"filled in {time.perf_counter() - began:.0f} s: {indexed:,} jobs indexed, "
          f"{args.tenants:,} tenants waiting, {keys:,} keys")  # fmt: skip
    port = free_port()
    dashboard = start_dashboard(url, port)
    base = f"http://127.0.0.1:{port}"
    try:
        await _until_up(base)
        print("api (median and max of", args.repeat, "answers):")
        print("\n".join(await api_times(base, marks, args.repeat)))
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            print(f"pages in Chromium, navigation to data shown (median and max of {args.repeat}):")
            print("\n".join(await page_times(browser, base, marks, args.repeat)))
            print(f"redis, {args.seconds:g} s each:")
            for tabs in (0, 1, 10):
                print(await redis_load(redis, browser, base, dashboard.pid, tabs, args.seconds))
            await browser.close()
    finally:
        dashboard.terminate()
        dashboard.wait()
        await redis.aclose()


def start_dashboard(url: str, port: int) -> subprocess.Popen[bytes]:
    """``chatstream dashboard`` in a process of its own (its CPU is measured apart)."""
    env = {**os.environ, "CHATSTREAM_REDIS_URL": url, "CHATSTREAM_PREFIX": PREFIX,
           "CHATSTREAM_LOG_LEVEL": "WARNING"}  # fmt: skip
    command = [sys.executable, "-m", "worker.cli", "dashboard", "--port", str(port)]
    return subprocess.Popen(command, env=env, cwd=ROOT)


async def _until_up(base: str) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        for _ in range(100):
            try:
                if (await http.get("/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise SystemExit("the dashboard did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.jobs, args.tenants, args.repeat, args.seconds = 5_000, 100, 2, 5.0
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("bench_dashboard needs redis-server on the PATH")
    with open("/proc/loadavg") as load:
        print(f"load before the run: {load.read().split()[0]} (1 min)")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            asyncio.run(run(f"redis://127.0.0.1:{port}/0", args))
        finally:
            server.terminate()
            server.wait()
    with open("/proc/loadavg") as load:
        print(f"load after the run: {load.read().split()[0]} (1 min)")


if __name__ == "__main__":
    main()
