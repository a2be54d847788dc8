"""The dashboard's HTTP API served by uvicorn on loopback, beside an in-process worker (the
``harness``): reads without a key, actions and content with one, hostile input answered
4xx, the app mounted under a path of another app, Redis unreachable."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.routing import Mount

from tests.helpers.harness import Harness, chat
from worker.dashboard import create_app, serve_dashboard
from worker.settings import Settings
from worker.store.activity import ActivityLog, minute_of

KEY = "sk-ops-unit"
HEADER = "X-Chatstream-Dashboard-Key"


@pytest.fixture
async def dash(harness: Harness) -> AsyncIterator[tuple[Harness, str]]:
    settings = harness.settings.model_copy(update={"dashboard_keys": SecretStr(f"ops={KEY}")})
    async with serve_dashboard(settings, harness.redis, host="127.0.0.1", port=0) as url:
        yield harness, url


def http(url: str, key: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={HEADER: key} if key else {}, timeout=10)


async def test_a_job_shows_its_attempts_and_its_content_only_with_a_key(
    dash: tuple[Harness, str],
) -> None:
    h, url = dash
    record = await h.run(chat("tell me"), tenant="acme")
    async with http(url) as anyone, http(url, KEY) as operator:
        hidden = (await anyone.get(f"/api/jobs/{record.id}")).json()
        shown = (await operator.get(f"/api/jobs/{record.id}")).json()
        listed = (await anyone.get("/api/jobs", params={"tenant": "acme"})).json()
        replay = (await operator.get(f"/api/jobs/{record.id}/events")).text
    assert hidden["record"]["content"] == {"hidden": True, "characters": len(record.content)}
    raw = await h.redis.hget(h.client.keys.job(record.id), "request") or ""
    assert hidden["record"]["request_summary"] == {
        "model": "mock-model",
        "messages": 1,
        "characters": len(raw),
    }
    assert "tell me" not in json.dumps(hidden) and "tell me" in json.dumps(shown)
    assert shown["record"]["content"] == record.content
    [attempt] = shown["attempts"]
    assert attempt["attempt"] == 1 and attempt["end"] == "done" and attempt["deltas"] > 0
    assert [job["id"] for job in listed["jobs"]] == [record.id]
    assert listed["jobs"][0]["tenant"] == "acme"
    frames = [json.loads(line[6:]) for line in replay.splitlines() if line.startswith("data: ")]
    assert frames[-1]["type"] == "done" and len(frames) == attempt["deltas"] + 1


async def test_actions_need_an_operators_key(dash: tuple[Harness, str]) -> None:
    h, url = dash
    scheduler = h.client.queue.scheduler
    async with http(url) as anyone, http(url, "sk-wrong") as wrong, http(url, KEY) as operator:
        assert (await anyone.post("/api/upstreams/default/pause")).status_code == 401
        assert (await wrong.post("/api/upstreams/default/pause")).status_code == 403
        assert await scheduler.paused() == {}
        paused = await operator.post("/api/upstreams/default/pause")
        assert paused.json() == {"upstream": "default", "paused": True, "changed": True}
        assert list(await scheduler.paused()) == ["default"]
        job_id = await h.client.enqueue(chat())  # held: the upstream is paused
        cancelled = (await operator.post(f"/api/jobs/{job_id}/cancel")).json()
        assert cancelled == {"id": job_id, "status": "cancelled"}
        resumed = await operator.post("/api/upstreams/default/resume")
        assert resumed.json()["changed"] is True and await scheduler.paused() == {}
        session = (await operator.get("/api/session")).json()
        assert (
            session["operator"] == "ops"
            and (await anyone.get("/api/session")).json()["operator"] is None
        )


HOSTILE = [
    ("GET", "/api/jobs?status=bogus", 400),
    ("GET", "/api/jobs?limit=0", 400),
    ("GET", "/api/jobs?limit=abc", 400),
    ("GET", "/api/jobs?since=yesterday", 400),
    ("GET", "/api/jobs?since=nan", 400),
    ("GET", "/api/jobs?before=inf", 400),
    ("GET", "/api/jobs?limit=%D9%A1%D9%A2", 400),
    ("GET", "/api/jobs?tenant=a%3Ab", 400),
    ("GET", "/api/jobs/" + "x" * 200, 404),
    ("GET", "/api/jobs/a%20b", 404),
    ("GET", "/api/jobs/nope", 404),
    ("GET", "/api/jobs/nope/events?after=%EF%BC%91", 400),
    ("GET", "/api/jobs/nope/events", 404),
    ("GET", "/api/dead?before=abc", 400),
    ("GET", "/api/dead?limit=100000", 400),
    ("GET", "/api/activity?minutes=5", 400),
    ("POST", "/api/dead/abc/delete", 400),
    ("POST", "/api/dead/1-1/delete", 404),
    ("POST", "/api/jobs/nope/cancel", 404),
    ("POST", "/api/jobs/nope/requeue", 404),
    ("POST", "/api/upstreams/a:b/pause", 404),
    ("GET", "/api/upstreams/default/pause", 405),
    ("GET", "/nowhere", 404),
]


async def test_hostile_input_gets_a_clear_4xx(dash: tuple[Harness, str]) -> None:
    h, url = dash
    done = await h.run(chat())
    async with http(url, KEY) as operator:
        for method, path, status in HOSTILE:
            response = await operator.request(method, path)
            assert response.status_code == status, (method, path, response.text)
            assert response.json()["error"]["message"], path
        requeue = await operator.post(f"/api/jobs/{done.id}/requeue")
        assert requeue.status_code == 409 and "succeeded" in requeue.json()["error"]["message"]


async def test_the_charts_cover_up_to_a_day_in_sixty_points(dash: tuple[Harness, str]) -> None:
    h, url = dash
    now = minute_of(time.time())
    log = ActivityLog(h.redis, h.worker.keys)
    await log.add(now - 100, {"n:succeeded": 7, "tok": 70})
    await log.add(now, {"n:failed": 1, "f:upstream": 1})
    async with http(url) as anyone:
        day = (await anyone.get("/api/activity", params={"minutes": 1440})).json()
        hour = (await anyone.get("/api/activity")).json()
    assert day["step_seconds"] == 1440 and len(day["finished"]) == 60
    assert sum(day["finished"]) == 8 and day["failures"] == {"upstream": [0] * 59 + [1]}
    assert day["finished"][-1] == 1 and day["finished"][-5] == 7  # 100 minutes: 4 steps back
    assert hour["step_seconds"] == 60 and sum(hour["finished"]) == 1


async def test_it_mounts_under_a_path_of_another_app(settings: Settings) -> None:
    app = create_app(settings)
    host = Starlette(routes=[Mount("/ops", app=app)])
    transport = httpx.ASGITransport(app=host)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            page = await client.get("/ops/")
            script = await client.get("/ops/dash.js")
            overview = (await client.get("/ops/api/overview")).json()
            bare = await client.get("/ops")
    finally:
        await app.state.dashboard.aclose()
    assert page.status_code == 200 and 'src="dash.js"' in page.text
    assert "content-security-policy" in page.headers
    assert script.status_code == 200 and '"api/live"' in script.text  # relative URLs
    assert overview["totals"]["waiting"] == 0
    assert bare.status_code in (307, 308) and bare.headers["location"].endswith("/ops/")


async def test_redis_unreachable_is_said_not_a_500(
    settings: Settings, unused_tcp_port: int
) -> None:
    settings = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{unused_tcp_port}/0"})
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://d") as client:
            overview = await client.get("/api/overview")
            health = await client.get("/healthz")
            jobs = await client.get("/api/jobs")
    finally:
        await app.state.dashboard.aclose()
    assert overview.status_code == 200 and overview.json()["error"].startswith("Redis: ")
    assert health.status_code == 503 and jobs.status_code == 503
