"""The gateway's refusals: auth, ownership, limits, bad input, CORS, Redis down.

Each gets the right status, OpenAI's error JSON with one clear message, and loses nothing:
a refused request enqueues no job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.helpers.checks import eventually, jobs_queued
from tests.helpers.gateway_env import KEY, OTHER_KEY, GatewayEnv, key_setting, running_gateway
from tests.helpers.harness import chat
from worker.errors import ConfigError
from worker.gateway import create_app, serve_gateway
from worker.logs import secrets_of
from worker.settings import Settings
from worker.testing.mock_upstream import MockUpstream

COMPLETIONS = "/v1/chat/completions"
ASYNC = {"prefer": "respond-async"}
STREAM = {**chat("hi"), "stream": True}


@pytest.fixture
async def idle(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    """No worker (jobs stay queued, streams stay open); small limits."""
    async with running_gateway(
        settings,
        redis,
        mock_upstream,
        worker=False,
        gateway_keepalive_seconds=0.2,
        gateway_max_streams_per_key=2,
        gateway_max_connections=3,
        gateway_jobs_per_minute=6,
        gateway_max_body_bytes=2048,
    ) as env:
        yield env


def assert_error(response: httpx.Response, status: int, code: str | None, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert fragment in error["message"], error["message"]


async def queue_length(env: GatewayEnv) -> int:
    return await jobs_queued(env.redis, env.client.keys)


async def create_job(http: httpx.AsyncClient) -> str:
    response = await http.post(COMPLETIONS, json=STREAM, headers=ASYNC)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


# -- auth -------------------------------------------------------------------------------------

ENDPOINTS = [
    ("POST", COMPLETIONS),
    ("GET", "/v1/jobs/some-job"),
    ("GET", "/v1/jobs/some-job/events"),
    ("POST", "/v1/jobs/some-job/cancel"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize(
    ("authorization", "code", "fragment"),
    [
        (None, "missing_api_key", "missing API key"),
        ("Bearer sk-wrong", "invalid_api_key", "invalid API key"),
        (f"Basic {KEY}", "missing_api_key", "Bearer"),
        ("Bearer", "missing_api_key", "missing API key"),
    ],
)
async def test_no_valid_key_no_access(
    idle: GatewayEnv,
    method: str,
    path: str,
    authorization: str | None,
    code: str,
    fragment: str,
) -> None:
    headers = {"authorization": authorization} if authorization is not None else {}
    async with idle.http(None, **headers) as http:
        response = await http.request(method, path, json=STREAM)
    assert_error(response, 401, code, fragment)
    assert await queue_length(idle) == 0


async def test_a_key_configured_by_its_sha256_works(idle: GatewayEnv) -> None:
    async with idle.http(OTHER_KEY) as http:
        response = await http.post(COMPLETIONS, json=STREAM, headers=ASYNC)
    assert response.status_code == 202


async def test_the_events_token_opens_that_jobs_events_and_nothing_else(idle: GatewayEnv) -> None:
    async with idle.http() as http, idle.http(None) as anonymous:
        accepted = (await http.post(COMPLETIONS, json=STREAM, headers=ASYNC)).json()
        other_job = await create_job(http)
        token = accepted["events_token"]
        job_id = accepted["id"]
        async with anonymous.stream("GET", accepted["events_url"]) as response:
            assert response.status_code == 200
            assert response.headers["x-chatstream-job-id"] == job_id
        refused = [
            await anonymous.get(f"/v1/jobs/{other_job}/events?token={token}"),
            await anonymous.get(f"/v1/jobs/{job_id}/events?token=forged"),
            await anonymous.get(f"/v1/jobs/no-such-job/events?token={token}"),
        ]
        no_bearer = await anonymous.get(f"/v1/jobs/{job_id}?token={token}")
    for response in refused:
        assert_error(response, 401, "invalid_token", "invalid events token")
    assert_error(no_bearer, 401, "missing_api_key", "missing API key")


def test_the_gateway_refuses_to_start_without_keys(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="CHATSTREAM_GATEWAY_API_KEYS"):
        create_app(settings)
    bad = settings.model_copy(update={"gateway_api_keys": key_setting("sha256:abc")})
    with pytest.raises(ConfigError, match="64 hex digits"):
        create_app(bad)


# -- limits -----------------------------------------------------------------------------------


async def test_open_streams_are_limited_per_key_and_in_all(idle: GatewayEnv) -> None:
    async with AsyncExitStack() as stack:
        http = await stack.enter_async_context(idle.http())
        other = await stack.enter_async_context(idle.http(OTHER_KEY))
        jobs = [await create_job(http) for _ in range(3)]
        streams = []
        for job_id in jobs[:2]:
            cm = http.stream("GET", f"/v1/jobs/{job_id}/events")
            streams.append(await stack.enter_async_context(cm))
        assert [s.status_code for s in streams] == [200, 200]
        third = await http.get(f"/v1/jobs/{jobs[2]}/events")
        assert_error(third, 429, "too_many_streams", "2 open streams")
        assert third.headers["retry-after"] == "1"
        queued = await queue_length(idle)
        too_many = await http.post(COMPLETIONS, json=STREAM)
        assert_error(too_many, 429, "too_many_streams", "2 open streams")
        assert await queue_length(idle) == queued  # refused before any job was made
        their_job = await create_job(other)
        theirs = await stack.enter_async_context(
            other.stream("GET", f"/v1/jobs/{their_job}/events")
        )
        assert theirs.status_code == 200  # another key has its own allowance
        queued = await queue_length(idle)
        full = await other.post(COMPLETIONS, json={**STREAM, "stream": False})
        assert_error(full, 503, "overloaded", "3 open streams")
        assert full.headers["retry-after"] == "1"
        assert await queue_length(idle) == queued  # refused before any job was made
        await streams[0].aclose()  # a closed stream gives its slot back

        async def accepted_again() -> bool:
            async with http.stream("GET", f"/v1/jobs/{jobs[2]}/events") as response:
                return response.status_code == 200

        await eventually(accepted_again, timeout=5)


async def test_jobs_per_minute_are_limited_per_key_across_gateways(
    idle: GatewayEnv,
) -> None:
    async with (
        serve_gateway(idle.settings, idle.redis, host="127.0.0.1", port=0) as second_url,
        idle.http() as http,
        httpx.AsyncClient(base_url=second_url, headers={"authorization": f"Bearer {KEY}"}) as http2,
        idle.http(OTHER_KEY) as other,
    ):
        accepted = [await http.post(COMPLETIONS, json=STREAM, headers=ASYNC) for _ in range(3)]
        accepted += [await http2.post(COMPLETIONS, json=STREAM, headers=ASYNC) for _ in range(3)]
        assert [r.status_code for r in accepted] == [202] * 6
        for client in (http, http2):
            refused = await client.post(COMPLETIONS, json=STREAM, headers=ASYNC)
            assert_error(refused, 429, "rate_limit_exceeded", "6 jobs per minute")
            assert 1 <= int(refused.headers["retry-after"]) <= 10
        assert (await other.post(COMPLETIONS, json=STREAM, headers=ASYNC)).status_code == 202
    assert await queue_length(idle) == 7


async def test_a_refused_request_does_not_spend_the_keys_rate(idle: GatewayEnv) -> None:
    async with idle.http() as http:
        for _ in range(10):
            bad = await http.post(COMPLETIONS, json={"model": "m"}, headers=ASYNC)
            assert_error(bad, 400, "invalid_request", "messages: Field required")
        accepted = [await http.post(COMPLETIONS, json=STREAM, headers=ASYNC) for _ in range(6)]
    assert [r.status_code for r in accepted] == [202] * 6


# -- bad input --------------------------------------------------------------------------------

DEEP = ("[" * 100_000).encode()
BAD_BODIES = [
    pytest.param(b"{not json", 400, "invalid_json", "not valid JSON", id="malformed"),
    pytest.param(DEEP[:2000], 400, "invalid_json", "not valid JSON", id="unterminated"),
    pytest.param(b"[1, 2]", 400, "invalid_request", "must be a JSON object", id="array"),
    pytest.param(b'{"model": "m"}', 400, "invalid_request", "messages", id="no-messages"),
    pytest.param(
        json.dumps({**chat("hi"), "model": " "}).encode(),
        400,
        "invalid_request",
        "model",
        id="blank-model",
    ),
    *(
        pytest.param(
            json.dumps({**chat("hi"), "n": n}).encode(),
            400,
            "invalid_request",
            "n must be an integer from 1 to 128",
            id=f"n={n!r}",
        )
        for n in (0, -1, 129, 10**6, 2.0, "2", True, [2])
    ),
    pytest.param(
        json.dumps({**chat("hi"), "stream": "yes"}).encode(),
        400,
        "invalid_request",
        "stream",
        id="stream",
    ),
    pytest.param(
        json.dumps({**chat("hi"), "stream_options": 3}).encode(),
        400,
        "invalid_request",
        "stream_options",
        id="stream-options",
    ),
    pytest.param(
        json.dumps({**chat("x" * 3000)}).encode(),
        413,
        "request_too_large",
        "2048 bytes",
        id="too-large",
    ),
]


@pytest.mark.parametrize(("body", "status", "code", "fragment"), BAD_BODIES)
async def test_a_bad_request_body_is_refused_with_one_clear_message(
    idle: GatewayEnv, body: bytes, status: int, code: str, fragment: str
) -> None:
    async with idle.http(**{"content-type": "application/json"}) as http:
        response = await http.post(COMPLETIONS, content=body)
    assert_error(response, status, code, fragment)
    assert await queue_length(idle) == 0


@pytest.mark.parametrize("n", [None, 1, 2, 128])
async def test_n_up_to_openais_limit_is_accepted(idle: GatewayEnv, n: int | None) -> None:
    async with idle.http() as http:
        response = await http.post(COMPLETIONS, json={**STREAM, "n": n}, headers=ASYNC)
    assert response.status_code == 202, response.text
    record = await idle.client.get(response.json()["id"])
    assert record.request is not None and record.request.get("n") == n  # goes upstream as sent


async def test_an_oversized_body_without_content_length_is_refused(idle: GatewayEnv) -> None:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 1000  # chunked: the size is known only while reading

    async with idle.http() as http:
        response = await http.post(COMPLETIONS, content=body())
    assert_error(response, 413, "request_too_large", "2048 bytes")


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code", "fragment"),
    [
        (
            "GET",
            "/v1/jobs/{job}/events",
            {"last-event-id": "yesterday"},
            400,
            "invalid_cursor",
            "entry id",
        ),
        ("GET", "/v1/jobs/{job}/events?after=1-2-3", {}, 400, "invalid_cursor", "entry id"),
        (
            "GET",
            "/v1/jobs/{job}/events?format=xml",
            {},
            400,
            "invalid_format",
            "openai or chatstream",
        ),
        (
            "POST",
            COMPLETIONS,
            {"idempotency-key": "x" * 300},
            400,
            "invalid_idempotency_key",
            "255",
        ),
        ("GET", "/v1/nothing-here", {}, 404, None, "no route /v1/nothing-here"),
        ("DELETE", COMPLETIONS, {}, 405, None, "method DELETE not allowed"),
        ("GET", "/v1/jobs/bad%20id!", {}, 404, "job_not_found", "no job"),
    ],
)
async def test_bad_requests_get_the_right_status(
    idle: GatewayEnv,
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
    code: str | None,
    fragment: str,
) -> None:
    async with idle.http() as http:
        job_id = await create_job(http)
        response = await http.request(method, path.format(job=job_id), headers=headers, json=STREAM)
    assert_error(response, status, code, fragment)
    assert await queue_length(idle) == 1  # only the job made above


# -- CORS and Redis -----------------------------------------------------------------------------

PREFLIGHT = {
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type, idempotency-key",
}


async def test_cors_is_off_by_default(idle: GatewayEnv) -> None:
    async with idle.http(origin="https://app.example") as http:
        preflight = await http.options(COMPLETIONS, headers=PREFLIGHT)
        response = await http.post(COMPLETIONS, json=STREAM, headers=ASYNC)
    assert "access-control-allow-origin" not in preflight.headers
    assert "access-control-allow-origin" not in response.headers


async def test_cors_allows_exactly_the_configured_origins(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    origins = ["https://app.example"]
    async with running_gateway(
        settings, redis, mock_upstream, worker=False, gateway_cors_origins=origins
    ) as env:
        async with env.http(None, origin="https://app.example") as allowed:
            preflight = await allowed.options(COMPLETIONS, headers=PREFLIGHT)
            response = await allowed.post(
                COMPLETIONS, json=STREAM, headers={**ASYNC, "authorization": f"Bearer {KEY}"}
            )
        async with env.http(None, origin="https://evil.example") as other:
            refused = await other.options(COMPLETIONS, headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "idempotency-key" in preflight.headers["access-control-allow-headers"]
    assert "traceparent" in preflight.headers["access-control-allow-headers"]
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-chatstream-job-id" in response.headers["access-control-expose-headers"]
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


async def test_redis_down_is_a_503(settings: Settings) -> None:
    down = Redis.from_url("redis://127.0.0.1:9/0", decode_responses=True)  # nothing listens
    configured = settings.model_copy(update={"gateway_api_keys": key_setting(KEY)})
    async with (
        serve_gateway(configured, down, host="127.0.0.1", port=0) as url,
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        response = await http.post(COMPLETIONS, json=STREAM)
        health = await http.get("/healthz")
    assert_error(response, 503, "unavailable", "Redis is unavailable")
    assert response.headers["retry-after"] == "1"
    assert health.status_code == 503


async def test_no_api_key_reaches_redis_or_the_logs(
    idle: GatewayEnv, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with idle.http() as http, idle.http("sk-wrong") as wrong:
        job_id = await create_job(http)
        await http.get(f"/v1/jobs/{job_id}")
        await wrong.get(f"/v1/jobs/{job_id}")
        await http.post(f"/v1/jobs/{job_id}/cancel")
    stored: list[str] = []
    async for key in idle.redis.scan_iter(f"{idle.settings.prefix}:*"):
        stored.append(key)
        kind = await idle.redis.type(key)
        if kind == "hash":
            stored += [str(v) for v in (await idle.redis.hgetall(key)).values()]
        elif kind == "stream":
            rows: Any = await idle.redis.xrange(key)
            stored += [json.dumps(fields) for _, fields in rows]
        elif kind == "string":
            stored.append(str(await idle.redis.get(key)))
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for secret in (KEY, OTHER_KEY):
        assert not any(secret in text for text in stored)
        assert secret not in logged
    assert KEY in secrets_of(idle.settings)  # masked, should a log line ever carry it
