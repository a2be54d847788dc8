"""The page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The reply renders live through ``EventSource``; a reload in the middle of the reply
resumes after the last entry the page applied, without repeating or losing text.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.async_api import Browser, expect
from redis.asyncio import Redis

from schemas.jobs import JobStatus
from tests.helpers.browser import text
from tests.helpers.gateway_env import (
    KEY,
    SCRIPT_USAGE,
    GatewayEnv,
    delta,
    openai_chunk,
    running_gateway,
)
from worker.settings import Settings
from worker.testing.mock_upstream import MockConfig, MockUpstream, expected_reply, serve_mock

SLOW = MockConfig(tokens=60, rate=25.0, words="streams survive reloads because Redis keeps them")


@pytest.fixture
async def gw(settings: Settings, redis: Redis) -> AsyncIterator[GatewayEnv]:
    app = MockUpstream(SLOW)
    async with (
        serve_mock(app=app) as url,
        running_gateway(settings, redis, (app, url)) as env,
    ):
        yield env


async def test_the_page_streams_the_reply_and_a_reload_resumes_it(
    gw: GatewayEnv, browser: Browser
) -> None:
    page = await browser.new_page()
    events_urls: list[str] = []
    page.on("request", lambda r: events_urls.append(r.url) if "/events" in r.url else None)
    await page.goto(f"{gw.url}/#key={KEY}&model=mock-model")
    assert "#" not in page.url  # the key left the address bar
    await page.fill("#prompt", "Why do streams survive a reload?")
    await page.click("#send")
    await expect(page.locator("#reply")).to_have_text(re.compile(".{40}"))
    before = await text(page, "#reply")
    job_id = (await text(page, "#status")).split("job ")[-1].rstrip(")")
    assert (await gw.client.get(job_id)).status is JobStatus.RUNNING  # mid-reply

    await page.reload()
    assert (await text(page, "#reply")).startswith(before)  # kept across the reload
    await expect(page.locator("#status")).to_have_text(re.compile("^done"), timeout=30_000)
    record = await gw.client.get(job_id)
    reply = expected_reply({"messages": []}, SLOW)
    assert await text(page, "#reply") == reply == record.content  # no repeat, no gap
    assert await text(page, "#status") == "done (stop)"

    first, resumed = events_urls[0], events_urls[-1]
    assert parse_qs(urlsplit(first).query)["after"] == ["0-0"]
    after = parse_qs(urlsplit(resumed).query)["after"][0]
    rows: Any = await gw.redis.xrange(gw.client.keys.events(job_id), min=f"({after}", max="+")
    assert after != "0-0" and any(fields["type"] == "delta" for _, fields in rows)
    await page.close()


async def test_the_page_shows_why_a_request_was_refused(gw: GatewayEnv, browser: Browser) -> None:
    page = await browser.new_page()
    await page.goto(f"{gw.url}/#key=sk-wrong&model=mock-model")
    await page.fill("#prompt", "hello")
    await page.click("#send")
    await expect(page.locator("#status")).to_have_text("error: invalid API key")
    await page.close()


REFUSAL_WORDS = [f" word{i}" for i in range(30)]
REFUSING = MockConfig(
    rate=20.0,
    script=(
        openai_chunk(delta(0, role="assistant", content=None, refusal="")),
        openai_chunk(delta(0, refusal="I can't help with that:")),
        *(openai_chunk(delta(0, refusal=word)) for word in REFUSAL_WORDS),
        openai_chunk(delta(0, "stop")),
        openai_chunk(choices=[], usage=SCRIPT_USAGE),
        "[DONE]",
    ),
)


async def test_the_page_shows_the_models_refusal_and_a_reload_resumes_it(
    settings: Settings, redis: Redis, browser: Browser
) -> None:
    """OpenAI streams a refusal in fragments, like content: the page renders it apart
    from the reply, and a reload mid-refusal resumes without repeating it."""
    app = MockUpstream(REFUSING)
    async with serve_mock(app=app) as url, running_gateway(settings, redis, (app, url)) as env:
        page = await browser.new_page()
        await page.goto(f"{env.url}/#key={KEY}&model=mock-model")
        await page.fill("#prompt", "Something it will not do")
        await page.click("#send")
        refusal = page.locator("#refusal")
        await expect(refusal).to_have_text(re.compile("^I can't help with that: word0 word1"))
        await expect(refusal).to_be_visible()
        before = await text(page, "#refusal")
        job_id = (await text(page, "#status")).split("job ")[-1].rstrip(")")
        assert (await env.client.get(job_id)).status is JobStatus.RUNNING  # mid-refusal
        await page.reload()
        assert (await text(page, "#refusal")).startswith(before)  # kept across the reload
        await expect(page.locator("#status")).to_have_text("done (stop)", timeout=30_000)
        record = await env.client.get(job_id)
        assert await text(page, "#refusal") == record.refusal
        assert record.refusal == "I can't help with that:" + "".join(REFUSAL_WORDS)
        assert await text(page, "#reply") == "" and record.content == ""
        await page.close()


async def test_the_page_says_why_its_job_waits(
    settings: Settings, redis: Redis, browser: Browser, unused_tcp_port: int
) -> None:
    """The worker's upstream refuses connections: the job's ``waiting`` entries reach the
    page (``?progress=events``), which shows what the job waits for instead of 'queued'."""
    closed = f"http://127.0.0.1:{unused_tcp_port}/v1"  # nothing listens there
    app = MockUpstream(SLOW)
    async with (
        serve_mock(app=app) as url,
        running_gateway(
            settings,
            redis,
            (app, url),
            upstream_url=closed,
            retry_attempts=None,  # the product's default: wait the outage out
            retry_initial_backoff=0.5,
            retry_max_backoff=2.0,
            job_timeout=15.0,
        ) as env,
    ):
        page = await browser.new_page()
        await page.goto(f"{env.url}/#key={KEY}&model=mock-model")
        await page.fill("#prompt", "Is anybody there?")
        await page.click("#send")
        status = page.locator("#status")
        await expect(status).to_have_text(
            re.compile(r"^waiting: upstream 'default' down for [0-9.]+ s .*\(job [0-9a-f]+\)$"),
            timeout=20_000,
        )
        job_id = (await text(page, "#status")).split("job ")[-1].rstrip(")")
        rows: Any = await redis.xrange(env.client.keys.events(job_id))
        assert [fields["type"] for _, fields in rows][:1] == ["waiting"]
        await page.close()
