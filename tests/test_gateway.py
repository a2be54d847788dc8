"""The HTTP gateway end to end: real redis-server, worker, mock upstream, uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.conftest import MOCK, chat
from tests.gateway_env import GatewayEnv, chunks_of, collect, content_of, running_gateway
from worker.mock_upstream import MockUpstream, expected_reply
from worker.settings import Settings


@pytest.fixture
async def gw(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    async with running_gateway(settings, redis, mock_upstream) as env:
        yield env


async def test_a_streamed_completion_is_openai_chunks_with_entry_ids(gw: GatewayEnv) -> None:
    request = {**chat("hi", tokens=5), "stream": True, "stream_options": {"include_usage": True}}
    async with (
        gw.http() as http,
        http.stream("POST", "/v1/chat/completions", json=request) as response,
    ):
        assert response.status_code == 200, await response.aread()
        job_id = response.headers["x-chatstream-job-id"]
        events = await collect(response)
    assert events[-1].data == "[DONE]"
    chunks = chunks_of(events)
    assert content_of(chunks) == expected_reply(chat("hi", tokens=5), MOCK)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    entries: Any = await gw.redis.xrange(gw.client.keys.events(job_id))
    assert events[-1].id == entries[-1][0]
