"""Routes on real worker processes (docs/routing.md): one model name served by several
targets, with mock upstreams that refuse, answer 500, 429 or 400, cut the stream, send an
error chunk after their 200, or cap open streams; health at the grain of the failure, kept
for the whole fleet."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from schemas.events import EventType
from tests.helpers.checks import eventually, statuses
from tests.helpers.fleet import Fleet
from tests.helpers.processes import CHATSTREAM, clean_env
from tests.helpers.servers import RedisServer, needs_redis_server
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockConfig, MockUpstream, serve_mock

pytestmark = pytest.mark.xdist_group("worker-processes")

CLOSED = "http://127.0.0.1:9/v1"  # nothing listens there: connection refused


@dataclass
class Routed:
    """A fleet whose route ``fast`` goes to ``primary`` (model p-model), then ``backup``
    (model b-model); each upstream an in-process mock."""

    fleet: Fleet
    primary: MockUpstream
    backup: MockUpstream
    urls: dict[str, str]

    async def start(self, n: int = 2, **settings: Any) -> None:
        await self.fleet.start(n, **settings)

    def faulty(self, mock: MockUpstream, **options: Any) -> None:
        mock.config = dataclasses.replace(mock.config, **options)

    async def run(self, count: int, timeout: float = 60, **request: Any) -> list[str]:
        ids = await self.fleet.client.enqueue_many([chat(**request) for _ in range(count)])
        await ended(self.fleet, ids, timeout)
        return ids


def chat(model: str = "fast", **mock: Any) -> dict[str, Any]:
    request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if mock:
        request["mock"] = mock
    return request


async def ended(fleet: Fleet, ids: list[str], timeout: float) -> None:
    async def done() -> bool:
        found = await statuses(fleet.redis, fleet.keys, ids)
        return all(status in ("succeeded", "failed", "cancelled") for status in found)

    await eventually(done, timeout, every=0.1)


def routes_env(routes: dict[str, Any], upstreams: dict[str, str]) -> dict[str, str]:
    return {
        "upstreams": json.dumps({name: {"url": url} for name, url in upstreams.items()}),
        "routes": json.dumps(routes),
    }


FAST = {
    "fast": {
        "targets": [
            {"upstream": "primary", "model": "p-model"},
            {"upstream": "backup", "model": "b-model"},
        ]
    }
}


@pytest.fixture
async def routed(
    redis_server: RedisServer | None, redis: RedisClient, prefix: str, tmp_path: Path
) -> AsyncIterator[Routed]:
    server = needs_redis_server(redis_server)
    primary, backup = MockUpstream(MockConfig(tokens=8)), MockUpstream(MockConfig(tokens=8))
    async with AsyncExitStack() as stack:
        urls = {
            "primary": await stack.enter_async_context(serve_mock(app=primary)),
            "backup": await stack.enter_async_context(serve_mock(app=backup)),
        }
        env = routes_env(FAST, urls)
        fleet = await stack.enter_async_context(
            Fleet.session(tmp_path, redis, server.url, prefix, urls["backup"], **env)
        )
        yield Routed(fleet, primary, backup, urls)


async def records(routed: Routed, ids: list[str]) -> list[Any]:
    return [await routed.fleet.client.get(job_id) for job_id in ids]


# -- what moves a job to the next target --------------------------------------------------


async def test_a_target_answering_500_costs_it_few_requests_and_every_job_succeeds(
    routed: Routed,
) -> None:
    """60 jobs at once against a primary that answers 500: every job succeeds on the backup,
    and the primary sees at most 15 requests (a few to learn it fails, then probes)."""
    routed.faulty(routed.primary, fault="http_500")
    await routed.start(2, concurrency=64)
    ids = await routed.run(60)
    found = await records(routed, ids)
    assert [r.status for r in found] == ["succeeded"] * 60
    assert {r.served_upstream for r in found} == {"backup"}
    assert {r.served_model for r in found} == {"b-model"}
    assert routed.primary.model_requests["p-model"] <= 15, routed.primary.model_requests
    assert routed.backup.model_requests["b-model"] == 60
    await routed.fleet.stop()


async def serve_one_job_after_another(routed: Routed, seconds: float) -> list[tuple[float, str]]:
    """A job every 0.2 s for ``seconds``: when each ended, and which upstream served it."""
    began, served = time.monotonic(), []
    while time.monotonic() - began < seconds:
        [job_id] = await routed.run(1)
        record = await routed.fleet.client.get(job_id)
        served.append((time.monotonic() - began, record.served_upstream or ""))
        await asyncio.sleep(0.2)
    return served


async def test_a_recovered_target_is_back_in_rotation_within_12_seconds(routed: Routed) -> None:
    """The primary fails for 16 s (its cooldown has grown to its cap, 8 s), then recovers:
    within 12 s new jobs are back on it, and stay there."""
    routed.faulty(routed.primary, fault="http_503")
    await routed.start(2)
    during = await serve_one_job_after_another(routed, 16)
    assert {upstream for _, upstream in during} == {"backup"}
    routed.faulty(routed.primary, fault=None)
    after = await serve_one_job_after_another(routed, 15)
    back = next(at for at, upstream in after if upstream == "primary")
    assert back <= 12, after
    later = [upstream for at, upstream in after if at >= 12]
    assert later.count("primary") / len(later) >= 0.9, after
    await routed.fleet.stop()


async def test_refused_connections_take_the_upstream_down_and_jobs_go_on(
    routed: Routed, tmp_path: Path
) -> None:
    routed.fleet.configure(**routes_env(FAST, {"primary": CLOSED, "backup": routed.urls["backup"]}))
    await routed.start(2)
    ids = await routed.run(20)
    assert {r.served_upstream for r in await records(routed, ids)} == {"backup"}
    assert [r.status for r in await records(routed, ids)] == ["succeeded"] * 20
    down = await routed.fleet.redis.hgetall(f"{routed.fleet.keys.sched(0)}:down:primary")
    assert "connection refused" in down["why"]
    await routed.fleet.stop()


async def test_a_429_moves_the_job_and_pauses_only_that_target(routed: Routed) -> None:
    routed.faulty(routed.primary, fault="http_429", retry_after=30.0)
    await routed.start(2)
    ids = await routed.run(10)
    assert {r.served_upstream for r in await records(routed, ids)} == {"backup"}
    down = await routed.fleet.redis.hgetall(f"{routed.fleet.keys.sched(0)}:down:primary|p-model")
    assert int(down["until"]) - int(down["since"]) >= 25_000  # its Retry-After, for the fleet
    assert routed.primary.model_requests["p-model"] <= 5
    await routed.fleet.stop()


async def test_a_400_fails_the_job_with_the_upstreams_message_and_no_other_target_sees_it(
    routed: Routed,
) -> None:
    routed.faulty(routed.primary, fault="http_400")
    await routed.start(1)
    [job_id] = await routed.run(1)
    record = await routed.fleet.client.get(job_id)
    assert record.status == "failed"
    assert record.error is not None and record.error["status"] == 400
    assert record.error["detail"]["message"] == "mock: HTTP 400"
    assert record.served_upstream == "primary"
    assert routed.backup.model_requests["b-model"] == 0
    await routed.fleet.stop()


async def test_an_overloaded_error_chunk_inside_a_200_moves_the_job_unseen(routed: Routed) -> None:
    """Anthropic's `overloaded_error` after the 200 and before any content: the job goes to
    the backup in the same attempt; its stream shows no reset and one reply."""
    routed.faulty(routed.primary, fault="midstream_error", fault_after=0, error_status=529)
    await routed.start(1)
    [job_id] = await routed.run(1)
    record = await routed.fleet.client.get(job_id)
    assert (record.status, record.served_upstream, record.attempt) == ("succeeded", "backup", 1)
    events = [event async for event in routed.fleet.client.events(job_id, block_ms=100)]
    assert EventType.RESET not in [event.type for event in events]
    assert events[-1].data["served"] == {
        "upstream": "backup",
        "model": "b-model",
        "route": "fast",
    }
    await routed.fleet.stop()


async def test_a_stream_cut_after_content_continues_on_the_next_target_with_a_reset(
    routed: Routed,
) -> None:
    routed.faulty(routed.primary, fault="disconnect", fault_after=3)
    await routed.start(1, retry_after_output="true")
    [job_id] = await routed.run(1)
    record = await routed.fleet.client.get(job_id)
    assert (record.status, record.served_upstream, record.attempt) == ("succeeded", "backup", 2)
    events = [event async for event in routed.fleet.client.events(job_id, block_ms=100)]
    [reset] = [event for event in events if event.type is EventType.RESET]
    assert reset.data["after"]["upstream"] == "primary"
    await routed.fleet.stop()


async def test_without_retry_after_output_a_cut_after_content_fails(routed: Routed) -> None:
    routed.faulty(routed.primary, fault="disconnect", fault_after=3)
    await routed.start(1)
    [job_id] = await routed.run(1)
    record = await routed.fleet.client.get(job_id)
    assert (record.status, record.served_upstream) == ("failed", "primary")
    assert routed.backup.model_requests["b-model"] == 0
    await routed.fleet.stop()


async def test_a_target_at_its_limit_spills_over_to_the_next(routed: Routed) -> None:
    """The primary allows 2 open streams (the fleet's limit says so): the rest of a burst
    goes to the backup instead of waiting; the primary never sees a 429."""
    routed.faulty(routed.primary, max_concurrent=2, rate=20.0)
    upstreams = {
        "primary": {"url": routed.urls["primary"], "max_concurrent": 2},
        "backup": {"url": routed.urls["backup"]},
    }
    await routed.start(2, upstreams=json.dumps(upstreams))
    ids = await routed.run(20, rate=20.0)
    found = await records(routed, ids)
    assert [r.status for r in found] == ["succeeded"] * 20
    by = [r.served_upstream for r in found]
    assert by.count("primary") >= 2 and by.count("backup") >= 10, by
    assert routed.primary.rate_limited == 0
    await routed.fleet.stop()


async def test_when_every_target_is_down_jobs_wait_and_finish_once_one_is_back(
    routed: Routed,
) -> None:
    routed.faulty(routed.primary, fault="http_503")
    routed.faulty(routed.backup, fault="http_503")
    await routed.start(2, breaker_max_cooldown=1)
    ids = await routed.fleet.client.enqueue_many([chat() for _ in range(10)])
    await asyncio.sleep(4)
    assert set(await statuses(routed.fleet.redis, routed.fleet.keys, ids)) <= {
        "queued",
        "running",
    }
    routed.faulty(routed.backup, fault=None)
    await ended(routed.fleet, ids, 30)
    assert [r.status for r in await records(routed, ids)] == ["succeeded"] * 10
    await routed.fleet.stop()


async def test_weighted_targets_share_the_jobs_by_weight(routed: Routed) -> None:
    spread = {
        "spread": {
            "strategy": "weighted",
            "targets": [
                {"upstream": "primary", "model": "p-model", "weight": 1},
                {"upstream": "backup", "model": "b-model", "weight": 3},
            ],
        }
    }
    await routed.start(2, routes=json.dumps(spread))
    ids = await routed.run(80, model="spread")
    by = [r.served_upstream for r in await records(routed, ids)]
    assert 14 <= by.count("primary") <= 26, by  # 20 by weight
    await routed.fleet.stop()


# -- health at the grain, without routes: one URL, many models (LiteLLM, OpenRouter) --------


async def test_one_models_429_behind_a_gateway_does_not_stall_the_others(
    fleet: Fleet,
) -> None:
    """A gateway answers 429 for one model and streams the others: jobs for the others
    finish at once; the failing model's jobs wait, and at their timeout each fails naming
    its own last answer, status and the gateway's message."""
    fleet.mock.config = dataclasses.replace(
        fleet.mock.config, models={"bad-model": {"fault": "http_429", "retry_after": 0.2}}
    )
    await fleet.start(2, job_timeout=4)
    bad = await fleet.client.enqueue_many([chat("bad-model") for _ in range(4)])
    began = time.monotonic()
    good = await fleet.client.enqueue_many([chat("good-model") for _ in range(20)])
    await ended(fleet, good, 10)
    assert time.monotonic() - began < 3
    assert set(await statuses(fleet.redis, fleet.keys, good)) == {"succeeded"}
    await ended(fleet, bad, 15)
    for job_id in bad:
        record = await fleet.client.get(job_id)
        assert record.status == "failed" and record.error is not None
        assert record.error["code"] == "upstream_timeout"
        assert record.error["status"] == 429, record.error
        assert "mock: HTTP 429" in record.error["detail"]["message"], record.error
    await fleet.stop()


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("routes", "says"),
    [
        (
            {"fast": {"targets": [{"upstream": "nowhere"}]}},
            "CHATSTREAM_ROUTES: route 'fast' target 0: unknown upstream 'nowhere'",
        ),
        ({"fast": {"targets": []}}, "CHATSTREAM_ROUTES__FAST__TARGETS: List should have"),
        (
            {"fast": {"targets": [{"upstream": "default", "weight": 0}]}},
            "CHATSTREAM_ROUTES__FAST__TARGETS__0__WEIGHT: Value error, weight 0.0 is not in",
        ),
        (
            {"default": {"targets": [{"upstream": "default"}]}},
            "CHATSTREAM_ROUTES: route 'default' is named like an upstream",
        ),
    ],
)
def test_a_bad_route_stops_the_worker_at_start_with_one_line(
    routes: dict[str, Any], says: str, tmp_path: Path
) -> None:
    env = {**clean_env(), "CHATSTREAM_ROUTES": json.dumps(routes)}
    command = [CHATSTREAM, "worker"]
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert done.stderr.startswith("chatstream: error: invalid settings: ")


async def test_a_prompt_too_long_for_the_targets_goes_to_the_routes_context_fallback(
    routed: Routed,
) -> None:
    routes = {
        "fast": {
            "targets": [{"upstream": "primary", "model": "p-model"}],
            "context_fallback": {"upstream": "backup", "model": "long-context"},
        }
    }
    routed.faulty(routed.primary, fault="context_length")
    await routed.start(1, routes=json.dumps(routes))
    [job_id] = await routed.run(1)
    record = await routed.fleet.client.get(job_id)
    assert (record.status, record.served_upstream, record.served_model) == (
        "succeeded",
        "backup",
        "long-context",
    )
    assert routed.primary.model_requests["p-model"] == 1
    await routed.fleet.stop()
