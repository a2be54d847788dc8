"""The dashboard's overview (worker/store/fleet.py, worker/dashboard/overview.py) against a
real redis-server: a fleet put together by hand on two queue shards, with limits, jobs
waiting by priority, running, dead, a paused and cooling upstream, a worker's report and
activity counts; every figure is what was put there."""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import SecretStr
from redis.asyncio import Redis

from schemas.requests import Priority
from tests.helpers.harness import chat, spread
from worker.client import Client
from worker.dashboard.core import Dashboard
from worker.settings import Route, RouteTarget, Settings, Upstream
from worker.store.activity import ActivityLog, minute_of
from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.queue import Queue
from worker.store.scheduler import TargetFailure, config_fields

REPORT = {
    "version": "9.9.9", "host": "box", "pid": 7, "started": 1.0, "slots": 8, "busy": 2,
    "waiting": 1, "processed": 40, "stopping": False,
    "down": {"default": {"for": 12.5, "error": "connection refused", "waiting": 1}},
}  # fmt: skip


async def build_fleet(settings: Settings, redis: Redis) -> tuple[Settings, dict[str, Any]]:
    settings = settings.model_copy(
        update={
            "queue_shards": 2,
            "upstream_max_concurrent": 4,
            "upstream_requests_per_minute": 100,
            "upstream_tokens_per_minute": 100_000,
            "max_attempts": 3,
        }
    )
    keys = Keys(settings.prefix, 2)
    worker = Queue(redis, keys, "w1")
    await worker.ensure_group()
    await worker.scheduler.publish(config_fields(settings))
    client = Client.from_settings(settings, redis)
    ids = spread(keys, per_shard=3)  # three jobs on each shard
    plan: list[tuple[str, Priority]] = [("t1", "high"), ("t1", "high"), ("t1", "low")]
    plan += [("t2", "normal"), ("t2", "normal"), ("t2", "low")]
    for job_id, (tenant, priority) in zip(ids, plan, strict=True):
        await client.enqueue(chat(), job_id=job_id, tenant=tenant, priority=priority)
    running = await worker.read(2, None)  # w1 runs two of them
    await redis.xadd(keys.dead, {"job": ids[5], "reason": json.dumps({"code": "x"})})
    liveness = Liveness(redis, keys, "w1", settings.heartbeat_timeout)
    await liveness.beat(json.dumps(REPORT))
    await worker.scheduler.cool_down("default", 30)
    await worker.scheduler.pause("default")
    minute = minute_of(time.time())
    counts = {"n:succeeded": 4, "n:failed": 1, "tok": 600, "f:upstream": 1, "t:t1:n": 5}
    await ActivityLog(redis, keys).add(minute, {**counts, "u:default:n": 5})
    return settings, {"ids": ids, "running": running}


async def test_every_figure_is_what_the_fleet_holds(settings: Settings, redis: Redis) -> None:
    settings, made = await build_fleet(settings, redis)
    dashboard = Dashboard(settings, redis)
    overview = json.loads(await dashboard.live.current())
    totals = overview["totals"]
    assert (totals["waiting"], totals["running"], totals["dead"]) == (4, 2, 1)
    assert (totals["workers"], totals["workers_alive"]) == (1, 1)
    assert totals["finished_last_hour"] == 5 and totals["failures_last_hour"] == {"upstream": 1}
    assert [s["waiting"] + s["running"] for s in overview["shards"]] == [3, 3]
    tenants = {row["name"]: row for row in overview["tenants"]}
    running_tenants = {entry.tenant for entry in made["running"]}
    assert sum(tenants[t]["running"] for t in tenants) == 2
    assert {t for t in tenants if tenants[t]["running"]} == running_tenants
    for row in tenants.values():  # waiting = the tenants' queues by priority + the stream's
        in_queues = sum(row["by_priority"].values())
        assert in_queues <= row["waiting"] and row["oldest_waiting_seconds"] is not None
    assert sum(row["waiting"] for row in tenants.values()) == 4
    assert tenants["t2"]["dead"] == 1 and tenants["t1"]["last_hour"]["n"] == 5

    [upstream] = overview["upstreams"]
    assert upstream["kind"] == "upstream" and upstream["target"] == "default"
    limits = upstream["limits"]
    assert (limits["max_concurrent"], limits["requests_per_minute"]) == (4, 100)
    out_of_queue = 6 - sum(sum(row["by_priority"].values()) for row in tenants.values())
    assert upstream["use"]["permits"] == upstream["use"]["requests_last_minute"] == out_of_queue
    assert upstream["use"]["tokens_last_minute"] > 0
    assert 25_000 < upstream["cooling_ms"] <= 30_000
    assert abs(upstream["paused_since"] - overview["now"]) < 5 and upstream["paused_shards"] == 2
    assert upstream["down"]["workers"] == 1 and upstream["down"]["error"] == "connection refused"
    assert 11 < overview["now"] - upstream["down"]["since"] < 15

    [worker] = overview["workers"]
    assert worker["state"] == "alive" and worker["pending"] == 2
    assert (worker["version"], worker["slots"], worker["busy"], worker["down"]) == (
        "9.9.9",
        8,
        2,
        ["default"],
    )


async def test_a_secret_in_redis_never_leaves_the_dashboard(
    settings: Settings, redis: Redis
) -> None:
    """Should a worker's report or a record hold a secret the dashboard's process knows, the
    answer masks it."""
    secret = "sk-upstream-in-a-report-123"
    settings = settings.model_copy(update={"upstream_api_key": SecretStr(secret)})
    keys = Keys(settings.prefix)
    report = {**REPORT, "down": {"default": {"for": 1, "error": f"bad key {secret}"}}}
    await Liveness(redis, keys, "w1", 3).beat(json.dumps(report))
    body = await Dashboard(settings, redis).live.current()
    assert secret.encode() not in body and b"bad key ***" in body


async def test_many_waiting_tenants_are_broken_down_a_chunk_per_read(
    settings: Settings, redis: Redis
) -> None:
    """No script call covers more than 50 tenants: the 249 waiting in their queues (one job
    went into the stream) take five reads; meanwhile the page shows the last complete pass
    (none yet), and the totals are exact at every read."""
    client = Client.from_settings(settings, redis)
    await Queue(redis, client.keys, "w").ensure_group()
    for n in range(250):
        await client.enqueue(chat(), tenant=f"t{n:03d}", priority="low" if n % 2 else "high")
    dashboard = Dashboard(settings, redis)
    seen = []
    for tick in range(5):
        overview = json.loads(await dashboard.read(tick))
        seen.append(sum(row["by_priority"]["low"] for row in overview["tenants"]))
        assert overview["totals"]["waiting"] == 250
    assert seen[:4] == [0, 0, 0, 0] and seen[4] > 0, seen  # (the overview's top 100 rows)
    rows = await dashboard.tenants()
    assert len(rows) == 250 and sum(row["by_priority"]["low"] for row in rows) == 125
    assert sum(row["by_priority"]["high"] for row in rows) == 124  # one in the stream


async def test_a_route_and_its_targets_as_the_fleet_holds_them(
    settings: Settings, redis: Redis
) -> None:
    """A route of two targets, the first taken down for the fleet: a route row (waiting,
    one target of two down, fallbacks of the last hour), each target's breaker; a pause
    of the route holds its jobs in their queues."""
    routes = {
        "fast": Route(
            targets=[RouteTarget(upstream="default", model="a"), RouteTarget(upstream="b")]
        )
    }
    upstreams = {"b": Upstream(url="http://127.0.0.1:9/v1")}
    settings = settings.model_copy(update={"routes": routes, "upstreams": upstreams})
    keys = Keys(settings.prefix)
    queue = Queue(redis, keys, "w1")
    await queue.ensure_group()
    await queue.scheduler.publish(config_fields(settings))
    failure = TargetFailure("default", "a", 1.0, 8.0, None, "HTTP 503: overloaded", "j0")
    await queue.scheduler.trip(failure)
    await queue.scheduler.pause("fast")
    client = Client.from_settings(settings, redis)
    await client.enqueue({**chat(), "model": "fast"})
    await client.enqueue({**chat(), "model": "fast"})
    minute = minute_of(time.time())
    await ActivityLog(redis, keys).add(minute, {"r:fast:n": 3, "r:fast:fb": 2})
    overview = json.loads(await Dashboard(settings, redis).live.current())
    rows = {row["name"]: row for row in overview["upstreams"]}
    route = rows["fast"]
    assert (route["kind"], route["target"], route["waiting"]) == ("route", "fallback", 2)
    assert (route["targets_down"], route["targets"]) == (1, 2)
    assert route["paused_since"] is not None and route["last_hour"]["fb"] == 2
    first, second = rows["fast → default / a"], rows["fast → b / fast"]
    assert first["kind"] == "target" and first["down"]["error"] == "HTTP 503: overloaded"
    assert 0 < first["down"]["until"] - overview["now"] <= 1.5
    assert second["down"] is None and not second["answered"]
    assert await queue.read(5, None) == []  # paused: nothing leaves the queue
    await queue.scheduler.resume("fast")
    assert {e.raw["upstream"] for e in await queue.read(5, None)} == {"b"}  # a trial of two
