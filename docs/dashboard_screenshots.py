"""The screenshots of docs/dashboard.md: ``python docs/dashboard_screenshots.py``.

A fleet on a bad day, on a redis-server started here (a free loopback port): the tests'
dashboard scene (tests/helpers/dashboard_env.py: a real worker with two slots, the mock
upstream, jobs succeeded, failed, dead-lettered, running and waiting), plus an upstream
``backup`` that refuses connections (its jobs wait in the worker: the worker reports it
down) and an upstream ``eu`` an operator paused with jobs held. The charts' minutes before
the last one are counts written here (a plausible day, with a burst of failures), not jobs
that ran: a real hour of traffic would take an hour. Writes docs/dashboard/<view>.png.
Needs Debian's chromium.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from playwright.async_api import Page, ViewportSize, async_playwright  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from tests.helpers.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tests.helpers.dashboard_env import OPERATOR_KEY, SLOW, Scene, dashboard_scene  # noqa: E402
from tests.helpers.harness import chat  # noqa: E402
from worker.settings import Settings, Upstream  # noqa: E402
from worker.store.activity import ActivityLog, minute_of  # noqa: E402

OUT = ROOT / "docs" / "dashboard"
VIEWPORT: ViewportSize = {"width": 1360, "height": 860}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def history(scene: Scene) -> None:
    """A day of per-minute counts before this minute, with a failure burst an hour ago."""
    log = ActivityLog(scene.redis, scene.client.keys)
    rng, now = random.Random(38), minute_of(time.time())
    for minute in range(now - 1440, now):
        burst = 0 < now - minute < 40 and now - minute > 25
        ended = rng.randint(40, 70)
        failed = rng.randint(8, 15) if burst else rng.randint(0, 2)
        counts = {"n:succeeded": ended - failed, "n:failed": failed, "tok": ended * 410,
                  f"ttft:{4 if burst else 3}": ended // 2, f"ttft:{7 if burst else 5}": ended // 2,
                  "f:upstream_retryable" if burst else "f:upstream_terminal": failed,
                  "u:default:n": ended, "u:default:f": failed, "t:acme:n": ended // 2,
                  "t:beta:n": ended // 3, "t:gamma:n": ended // 6}  # fmt: skip
        await log.add(minute, {name: value for name, value in counts.items() if value})


async def bad_day(scene: Scene) -> None:
    """An upstream down with jobs waiting for it, another paused with jobs held."""
    client = scene.client
    for tenant in ("acme", "delta"):
        await client.enqueue(chat("to backup", **SLOW), upstream="backup", tenant=tenant)
    await client.queue.scheduler.pause("eu")
    for tenant in ("beta", "delta", "delta"):
        await client.enqueue(chat("to eu", **SLOW), upstream="eu", tenant=tenant)
    await history(scene)
    await asyncio.sleep(8)  # the worker finds backup down; its report and a read say so


async def shoot(page: Page, scene: Scene, view: str, name: str, wait: str) -> None:
    await page.goto(f"{scene.url}/#/{view}")
    await page.locator(wait).first.wait_for(timeout=20_000)
    await page.wait_for_timeout(1_500)
    await page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
    print(f"wrote docs/dashboard/{name}.png")


async def run(url: str, settings: Settings) -> None:
    redis = Redis.from_url(url, decode_responses=True)
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens: connection refused
    updates = {"upstreams": {"backup": Upstream(url=closed), "eu": Upstream(url=closed)},
               "retry_attempts": None, "retry_max_backoff": 5.0, "job_timeout": 600.0,
               "concurrency": 6}  # fmt: skip
    async with dashboard_scene(settings, redis, **updates) as scene:
        await bad_day(scene)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page(viewport=VIEWPORT)
            await page.goto(scene.url + "/")
            await page.fill("#key", OPERATOR_KEY)
            await page.click("#key-form button")
            await page.locator("#operator").wait_for()
            shots = [("overview", "overview", "#tenants tbody tr[data-tenant]"),
                     ("upstreams", "upstreams", "#upstreams tbody tr[data-upstream]"),
                     ("workers", "workers", "#workers tbody tr[data-worker]"),
                     ("jobs?status=failed", "jobs", "#jobs tbody tr[data-job]"),
                     (f"job/{scene.jobs['running'][0]}", "job", "#job-record tr[data-field]"),
                     ("dead", "dead", "#dead tbody tr[data-entry]")]  # fmt: skip
            for view, name, wait in shots:
                await shoot(page, scene, view, name, wait)
            await browser.close()
    await redis.aclose()


def main() -> None:
    executable = shutil.which("redis-server")
    if executable is None:
        raise SystemExit("needs redis-server on the PATH")
    OUT.mkdir(exist_ok=True)
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    settings = Settings(_env_file=None, redis_url=url, prefix="chatstream", lease_seconds=10,
                        block_ms=100, log_level="WARNING")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        server = subprocess.Popen([*command, "--dir", directory], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            asyncio.run(run(url, settings))
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
