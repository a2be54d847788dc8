"""The gateway's tenants: a key's jobs belong to the tenant named beside it (else to its
id), ``X-Chatstream-Priority`` orders them (on both the chat and the Responses endpoint),
and a full tenant queue is a 429."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from tests.helpers.gateway_env import KEY, OTHER_KEY, GatewayEnv, running_gateway
from tests.helpers.harness import chat
from worker.gateway.auth import ApiKeys
from worker.settings import Settings
from worker.store.queue import Queue
from worker.store.scheduler import config_fields
from worker.testing.mock_upstream import MockUpstream

COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ASYNC = {"prefer": "respond-async"}
BODY = {**chat("hi"), "stream": True}
BACKGROUND = {"model": "mock-model", "input": "hi", "background": True}


@pytest.fixture
async def named(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    """No worker; KEY belongs to tenant acme, OTHER_KEY (as its sha256) to nobody named."""
    keys = ApiKeys.from_setting(SecretStr(OTHER_KEY)).keys[0]
    setting = SecretStr(f"acme={KEY},sha256:{keys.digest.hex()}")
    async with running_gateway(
        settings, redis, mock_upstream, worker=False, gateway_api_keys=setting, max_queued=2
    ) as env:
        queue = Queue(redis, env.client.keys, "w")
        await queue.ensure_group()
        await queue.scheduler.publish(config_fields(env.settings))
        yield env


async def submit(env: GatewayEnv, key: str, **headers: str) -> str:
    async with env.http(key, **ASYNC, **headers) as http:
        response = await http.post(COMPLETIONS, json=BODY)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


async def test_a_keys_jobs_belong_to_its_tenant_and_carry_their_priority(
    named: GatewayEnv,
) -> None:
    job_id = await submit(named, KEY, **{"x-chatstream-priority": "HIGH"})
    record = await named.client.get(job_id)
    assert (record.tenant, record.priority) == ("acme", "high")
    other = await named.client.get(await submit(named, OTHER_KEY))
    other_id = ApiKeys.from_setting(SecretStr(OTHER_KEY)).keys[0].id
    assert (other.tenant, other.priority) == (other_id, "normal")


async def test_a_background_response_carries_its_priority(named: GatewayEnv) -> None:
    async with named.http(KEY, **{"x-chatstream-priority": "low"}) as http:
        response = await http.post(RESPONSES, json=BACKGROUND)
    assert response.status_code == 200, response.text
    record = await named.client.get(response.headers["x-chatstream-job-id"])
    assert (record.tenant, record.priority) == ("acme", "low")


@pytest.mark.parametrize(("path", "body"), [(COMPLETIONS, BODY), (RESPONSES, BACKGROUND)])
async def test_a_bad_priority_is_a_400_and_creates_no_job(
    named: GatewayEnv, path: str, body: dict[str, Any]
) -> None:
    async with named.http(KEY, **ASYNC, **{"x-chatstream-priority": "urgent"}) as http:
        response = await http.post(path, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_priority"
    assert await named.redis.keys(named.client.keys.job("*")) == []


async def test_a_full_tenant_queue_is_a_429_with_retry_after(named: GatewayEnv) -> None:
    for _ in range(2):  # one dispatched into the stream, one waiting: the bound
        await submit(named, KEY)
    async with named.http(KEY, **ASYNC) as http:
        refused = await http.post(COMPLETIONS, json=BODY)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("queue_full", "rate_limit_error")
    assert "tenant 'acme' has 2 jobs waiting" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    await submit(named, OTHER_KEY)  # another tenant is not held back


def test_a_tenant_name_beside_a_key() -> None:
    keys = ApiKeys.from_setting(SecretStr("acme=sk-a, sk-plain, b.2=sha256:" + "0" * 64)).keys
    assert [key.tenant_name for key in keys[:1]] == ["acme"]
    assert keys[1].tenant == "" and keys[1].tenant_name == keys[1].id
    assert keys[2].tenant == "b.2"
    assert ApiKeys(keys).check("sk-a") is keys[0]
    assert ApiKeys(keys).check("acme=sk-a") is None  # the name is not part of the key
