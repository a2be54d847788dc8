"""The official ``openai`` SDK against the gateway and against the upstream directly.

The same request goes once straight to the mock upstream and once through the gateway
(which queues it as a job; a worker streams it from the same mock into Redis; the gateway
serves it back). The SDK must return the same content, tool calls, usage and finish
reason both ways: sync and async clients, ``stream=True`` (accumulated by the SDK's own
``ChatCompletionStreamState``) and ``stream=False``. Failures surface as the SDK's own
exceptions, as they do from OpenAI.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion
from redis.asyncio import Redis

from tests.gateway_env import KEY, GatewayEnv, running_gateway
from worker.mock_upstream import MockUpstream
from worker.settings import Settings

MESSAGES: list[Any] = [{"role": "user", "content": "What is a durable token stream?"}]
USAGE: Any = {"include_usage": True}
CASES = [
    pytest.param({"tokens": 20}, id="text"),
    pytest.param({"tokens": 6, "tool_calls": 3}, id="tool-calls"),
    pytest.param(
        {"tokens": 5, "reasoning": 4, "words": "héllo wörld ✓ 🚀"}, id="reasoning-unicode"
    ),
    pytest.param({"tokens": 30, "chunk_tokens": 7}, id="multi-token-chunks"),
]
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
]


@pytest.fixture
async def gw(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    async with running_gateway(settings, redis, mock_upstream) as env:
        yield env


def summary(completion: ChatCompletion) -> dict[str, Any]:
    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    return {
        "role": choice.message.role,
        "content": choice.message.content or "",
        "tool_calls": [
            (c.id, c.type, c.function.name, c.function.arguments)  # type: ignore[union-attr]
            for c in calls
        ],
        "usage": completion.usage.to_dict() if completion.usage else None,
        "finish_reason": choice.finish_reason,
    }


def kwargs(mock: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "mock-model",
        "messages": MESSAGES,
        "tools": TOOLS,
        "extra_body": {"mock": mock},
    }


async def async_call(base_url: str, api_key: str, stream: bool, mock: dict[str, Any]) -> Any:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        if not stream:
            return summary(await client.chat.completions.create(**kwargs(mock)))
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        chunks = await client.chat.completions.create(
            **kwargs(mock), stream=True, stream_options=USAGE
        )
        async for chunk in chunks:
            list(state.handle_chunk(chunk))
        return summary(state.get_final_completion())


def sync_call(base_url: str, api_key: str, stream: bool, mock: dict[str, Any]) -> Any:
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        if not stream:
            return summary(client.chat.completions.create(**kwargs(mock)))
        state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(
            **kwargs(mock), stream=True, stream_options=USAGE
        ):
            list(state.handle_chunk(chunk))
        return summary(state.get_final_completion())


async def call(
    flavour: str, base_url: str, api_key: str, stream: bool, mock: dict[str, Any]
) -> Any:
    if flavour == "async":
        return await async_call(base_url, api_key, stream, mock)
    return await asyncio.to_thread(sync_call, base_url, api_key, stream, mock)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("mock", CASES)
async def test_the_sdk_gets_the_same_reply_through_the_gateway(
    gw: GatewayEnv, flavour: str, stream: bool, mock: dict[str, Any]
) -> None:
    direct = await call(flavour, gw.settings.upstream_url, "unused", stream, mock)
    through = await call(flavour, f"{gw.url}/v1", KEY, stream, mock)
    assert through == direct
    assert direct["content"] and direct["usage"]["completion_tokens"] > 0
    assert len(direct["tool_calls"]) == mock.get("tool_calls", 0)


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_midstream_failure_raises_the_sdks_api_error(gw: GatewayEnv, flavour: str) -> None:
    mock = {"tokens": 8, "fault": "midstream_error", "fault_after": 3}
    for base_url, key in ((gw.settings.upstream_url, "unused"), (f"{gw.url}/v1", KEY)):
        with pytest.raises(openai.APIError) as caught:
            await call(flavour, base_url, key, True, mock)
        assert "failed mid-stream" in caught.value.message
        assert not isinstance(caught.value, openai.APIStatusError)  # it came in the stream


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
async def test_an_upstream_refusal_before_output_is_the_same_http_error(
    gw: GatewayEnv, stream: bool
) -> None:
    mock = {"fault": "http_400"}
    for base_url, key in ((gw.settings.upstream_url, "unused"), (f"{gw.url}/v1", KEY)):
        with pytest.raises(openai.BadRequestError) as caught:
            await call("async", base_url, key, stream, mock)
        assert caught.value.status_code == 400


async def test_the_sdk_sees_gateway_errors_as_its_own_exceptions(gw: GatewayEnv) -> None:
    with pytest.raises(openai.AuthenticationError):
        await call("async", f"{gw.url}/v1", "sk-wrong", True, {"tokens": 2})
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(model="mock-model", messages=[])
        assert "messages" in caught.value.message
