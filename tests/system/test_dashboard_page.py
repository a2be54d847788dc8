"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright),
on a live fleet (tests/helpers/dashboard_env.py): jobs succeeded, failed, dead-lettered,
running and waiting in their tenants' queues.

The numbers on the page are compared with what the test reads from Redis itself; they
change without a reload; a cancel and a requeue clicked on the page take effect; without a
key the page and the API are read-only and show no job content; no response carries a
secret.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page, Response, expect
from pydantic import SecretStr
from redis.asyncio import Redis

from tests.helpers.browser import text
from tests.helpers.checks import eventually
from tests.helpers.dashboard_env import (
    OPERATOR_KEY,
    QUICK,
    UPSTREAM_KEY,
    Scene,
    dashboard_scene,
)
from tests.helpers.harness import chat
from tests.helpers.servers import REDIS_PASSWORD, AuthRedisServer
from worker.settings import Settings
from worker.store.keys import GROUP

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def scene(settings: Settings, redis: Redis) -> AsyncIterator[Scene]:
    async with dashboard_scene(settings, redis) as ready:
        yield ready


async def truth(scene: Scene) -> dict[str, Any]:
    """The fleet as the test reads it from Redis, command by command (not through the
    dashboard's code): totals, and per tenant waiting (by priority), running and dead."""
    redis, keys = scene.redis, scene.client.keys
    sched = keys.sched(0)
    entries: Any = await redis.xrange(keys.queue)
    [group] = [g for g in await redis.xinfo_groups(keys.queue) if g["name"] == GROUP]
    pending: Any = await redis.xpending_range(keys.queue, GROUP, "-", "+", 1000)
    running_ids = {row["message_id"] for row in pending}
    delivered = tuple(int(p) for p in group["last-delivered-id"].split("-"))
    tenants: dict[str, dict[str, int]] = {}

    def row(name: str) -> dict[str, int]:
        return tenants.setdefault(name, dict.fromkeys(("waiting", "high", "normal", "low",
                                                        "running", "dead"), 0))  # fmt: skip

    for entry_id, fields in entries:
        if entry_id in running_ids:
            row(fields["tenant"])["running"] += 1
        elif tuple(int(p) for p in entry_id.split("-")) > delivered:
            row(fields["tenant"])["waiting"] += 1
    names: Any = await redis.zrange(sched + ":tenants", 0, -1)
    for tenant in names:
        queue = f"{sched}:q:{tenant}:default"
        for rank, priority in enumerate(("high", "normal", "low")):
            count = int(await redis.zcount(queue, rank * 1e13, f"({(rank + 1) * 1e13}"))
            row(tenant)[priority] += count
            row(tenant)["waiting"] += count
    letters: Any = await redis.xrange(keys.dead)
    for _, fields in letters:
        owner: Any = await redis.hget(keys.job(fields["job"]), "tenant")
        row(owner or "?")["dead"] += 1
    waiting = int(await redis.hget(sched + ":counts", "waiting") or 0)
    length = int(await redis.xlen(keys.queue))
    return {
        "waiting": waiting + length - len(running_ids),
        "running": len(running_ids),
        "dead": int(await redis.xlen(keys.dead)),
        "tenants": tenants,
    }


def number(value: str) -> int:
    return int(value.replace(",", ""))


async def cell(page: Page, tenant: str, column: str) -> int:
    return number(await text(page, f'tr[data-tenant="{tenant}"] td[data-col="{column}"]'))


async def test_the_numbers_on_the_page_are_redis_and_change_without_a_reload(
    scene: Scene, browser: Browser
) -> None:
    page = await browser.new_page()
    loads: list[str] = []
    page.on("framenavigated", lambda frame: loads.append(frame.url))
    await page.goto(scene.url + "/")
    expected = await truth(scene)
    assert expected["waiting"] == 5 and expected["running"] == 2 and expected["dead"] == 1
    await expect(page.locator("#total-waiting")).to_have_text(str(expected["waiting"]))
    assert number(await text(page, "#total-running")) == expected["running"]
    assert number(await text(page, "#total-dead")) == expected["dead"]
    for tenant, counts in expected["tenants"].items():
        for column, value in counts.items():
            assert await cell(page, tenant, column) == value, (tenant, column)
    assert await text(page, "#total-workers") == "1 / 1"

    more = [await scene.client.enqueue(chat("x", **QUICK), tenant="delta") for _ in range(2)]
    await expect(page.locator("#total-waiting")).to_have_text(str(expected["waiting"] + 2))
    await expect(page.locator('tr[data-tenant="delta"] td[data-col="waiting"]')).to_have_text("2")
    await page.click('a[data-view="jobs"]')
    await page.select_option("#f-status", "failed")
    await page.click("#job-filters button")
    failed = sorted([*scene.jobs["failed"], *scene.jobs["dead"]])
    await expect(page.locator("#jobs tbody tr")).to_have_count(len(failed))
    shown = await page.locator("#jobs tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.job)"
    )
    assert sorted(shown) == failed and more
    assert len({url.split("#")[0] for url in loads}) == 1 and len(loads) >= 1  # never reloaded
    await page.close()


async def use_key(page: Page, key: str) -> None:
    await page.fill("#key", key)
    await page.click("#key-form button")


async def test_a_cancel_and_a_requeue_from_the_page_take_effect(
    scene: Scene, browser: Browser
) -> None:
    page = await browser.new_page()
    await page.goto(scene.url + "/")
    await use_key(page, OPERATOR_KEY)
    await expect(page.locator("#operator")).to_have_text("operator: ops")

    running = scene.jobs["running"][0]
    await page.goto(f"{scene.url}/#/job/{running}")
    reply = page.locator("#job-reply")
    await expect(reply).to_have_text(re.compile("^tok0 tok1 .*tok40"))  # replayed, then live
    await page.click("#job-cancel")
    await scene.until(running, "cancelled")
    await expect(page.locator("#job-status")).to_have_text("cancelled")
    record = await scene.client.get(running)
    await expect(reply).to_have_text(record.content)  # the whole reply, and no more

    [dead] = scene.jobs["dead"]
    await page.goto(f"{scene.url}/#/dead")
    await page.click(f'tr[data-job="{dead}"] button:text("Requeue")')
    await expect(page.locator("#dead tbody tr")).to_have_text(["no dead letter"])
    assert await scene.redis.xlen(scene.client.keys.dead) == 0
    record = await scene.client.get(dead)
    assert record.status == "queued" and record.requeued_at is not None  # a fresh budget
    waits = await scene.client.queue.scheduler.ahead_of(dead, "gamma", "default")
    assert waits is not None  # in its tenant's queue again, behind the slow jobs' slots
    await page.close()


async def test_without_a_key_the_page_and_the_api_are_read_only(
    scene: Scene, browser: Browser
) -> None:
    page = await browser.new_page()
    running = scene.jobs["running"][0]
    await page.goto(f"{scene.url}/#/job/{running}")
    await expect(page.locator("#job-status")).to_have_text("running")
    await expect(page.locator("#job-cancel")).to_be_disabled()
    await expect(page.locator("#reply-note")).to_have_text(re.compile("enter an operator key"))
    assert await text(page, "#job-reply") == ""
    assert "tok0" not in await page.content()
    await page.goto(f"{scene.url}/#/dead")
    for label in ("Requeue", "Delete"):
        await expect(page.locator(f"#dead button:text('{label}')")).to_be_disabled()
    await page.goto(f"{scene.url}/#/upstreams")
    await expect(page.locator('tr[data-upstream="default"] button')).to_be_disabled()
    await use_key(page, "sk-not-an-operator")
    await expect(page.locator('tr[data-upstream="default"] button')).to_be_disabled()
    await page.close()

    [dead] = scene.jobs["dead"]
    letters: Any = await scene.redis.xrange(scene.client.keys.dead)
    entry = letters[0][0]
    actions = [f"/api/jobs/{running}/cancel", f"/api/jobs/{dead}/requeue",
               f"/api/dead/{entry}/delete", "/api/upstreams/default/pause"]  # fmt: skip
    for key, status in ((None, 401), ("sk-not-an-operator", 403)):
        async with scene.http(key) as http:
            for path in actions:
                assert (await http.post(path)).status_code == status, path
            assert (await http.get(f"/api/jobs/{running}/events")).status_code == status
            job = (await http.get(f"/api/jobs/{running}")).json()
    assert job["record"]["request"] == {"hidden": True, "characters": pytest.approx(100, abs=80)}
    assert "content_shown" in job and not job["content_shown"]
    assert (await scene.client.get(running)).status == "running"
    assert (await scene.client.get(dead)).status == "failed"
    assert await scene.redis.xlen(scene.client.keys.dead) == 1
    assert await scene.client.queue.scheduler.paused() == {}


GATEWAY_KEY = "sk-gateway-secret-never-shown"


@pytest.fixture
async def secret_scene(
    password_server: AuthRedisServer, settings: Settings
) -> AsyncIterator[Scene]:
    """The scene on a Redis with a password, with every kind of secret configured."""
    redis = Redis.from_url(password_server.url, decode_responses=True)
    updates = {"redis_url": password_server.url,
               "gateway_api_keys": SecretStr(f"team={GATEWAY_KEY}")}  # fmt: skip
    try:
        async with dashboard_scene(settings, redis, **updates) as ready:
            yield ready
    finally:
        await redis.aclose()


SECRETS = (UPSTREAM_KEY, OPERATOR_KEY, GATEWAY_KEY, REDIS_PASSWORD)


async def test_no_response_carries_a_secret(secret_scene: Scene, browser: Browser) -> None:
    scene = secret_scene
    bodies: list[bytes] = []
    page = await browser.new_page()

    async def keep(response: Response) -> None:
        if "event-stream" not in (response.headers.get("content-type") or ""):
            bodies.append(await response.body())

    page.on("response", keep)
    await page.goto(scene.url + "/")
    await use_key(page, OPERATOR_KEY)
    await expect(page.locator("#operator")).to_have_text("operator: ops")
    for view in ("upstreams", "workers", "jobs", "dead", f"job/{scene.jobs['failed'][0]}"):
        await page.goto(f"{scene.url}/#/{view}")
        await page.wait_for_timeout(300)
    await page.close()
    bodies += await api_bodies(scene)
    assert len(bodies) > 20
    for body in bodies:
        for secret in SECRETS:
            assert secret.encode() not in body, (secret, body[:300])
    assert any(b"redis://:***@127.0.0.1:" in body for body in bodies)  # the URL, masked


async def api_bodies(scene: Scene) -> list[bytes]:
    """Every endpoint, with and without the key, and the first events of both streams."""
    job = scene.jobs["failed"][0]
    paths = ["/api/session", "/api/overview", "/api/tenants", "/api/activity?minutes=1440",
             "/api/jobs", f"/api/jobs/{job}", "/api/dead", "/healthz", "/nope"]  # fmt: skip
    bodies = []
    for key in (None, OPERATOR_KEY):
        async with scene.http(key) as http:
            bodies += [(await http.get(path)).content for path in paths]
            bodies.append(await first_bytes(http, "/api/live"))
    async with scene.http(OPERATOR_KEY) as http:
        bodies.append(await first_bytes(http, f"/api/jobs/{scene.jobs['running'][0]}/events"))
    return bodies


async def first_bytes(http: httpx.AsyncClient, path: str, size: int = 20_000) -> bytes:
    got = b""
    async with http.stream("GET", path) as response:
        assert response.status_code == 200
        async with asyncio.timeout(10):
            async for part in response.aiter_bytes():
                got += part
                if len(got) >= size or b"overview" in got:
                    break
    return got


async def test_the_overview_reaches_every_open_page_from_one_read_loop(scene: Scene) -> None:
    """Ten pages follow the overview; the dashboard still reads the fleet once a second."""
    dashboard_reads = await reads_of(scene)
    async with scene.http() as http:
        streams = [asyncio.create_task(first_n_overviews(http, 3)) for _ in range(10)]
        results = await asyncio.gather(*streams)
    assert all(len(result) == 3 for result in results)
    done = await reads_of(scene) - dashboard_reads
    assert 2 <= done <= 6, done  # about three seconds of one loop, not ten loops

    async def quiet() -> bool:
        before = await reads_of(scene)
        await asyncio.sleep(1.5)
        return await reads_of(scene) == before

    await eventually(quiet, timeout=15)  # with no page open, nothing is read


async def reads_of(scene: Scene) -> int:
    async with scene.http() as http:
        reads: int = (await http.get("/healthz")).json()["reads"]
    return reads


async def first_n_overviews(http: httpx.AsyncClient, count: int) -> list[str]:
    seen: list[str] = []
    async with http.stream("GET", "/api/live") as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen.append(line)
                if len(seen) == count:
                    return seen
    return seen
