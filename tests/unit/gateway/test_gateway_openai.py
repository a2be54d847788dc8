"""The official ``openai`` SDK against the gateway and against the upstream directly.

The same request goes once straight to the mock upstream and once through the gateway
(which queues it as a job; a worker streams it from the same mock into Redis; the gateway
serves it back). The SDK must return the same reply both ways: every choice's content,
refusal, tool calls and finish reason, the usage, and the provider extras
(``web_search``, ``free_tier``: the last non-null value its chunks carried, or the
``chat.completion``'s own). Sync and async clients, ``stream=True`` (accumulated by the
SDK's own ``ChatCompletionStreamState``) and ``stream=False``. Failures surface as the
SDK's own exceptions, as they do from OpenAI.

Refusals, n > 1 and extras come from scripted streams shaped like OpenAI's (``usage:
null`` and ``obfuscation`` on every chunk, one choice per chunk, each choice finishing in
its own chunk). The mock has no non-streamed form of a script, so for those the reference
is the SDK's accumulation of the upstream's stream, with ``stream=False`` through the
gateway as well.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from schemas.jobs import EXTRAS
from tests.helpers.gateway_env import (
    KEY,
    SCRIPT_USAGE,
    GatewayEnv,
    delta,
    openai_chunk,
)

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


# -- scripted streams, shaped like OpenAI's --------------------------------------------------


REFUSAL = [
    openai_chunk(delta(0, role="assistant", content=None, refusal="")),
    openai_chunk(delta(0, refusal="I'm sorry,")),
    openai_chunk(delta(0, refusal=" but I can't help with that ✋.")),
    openai_chunk(delta(0, "stop")),
    openai_chunk(choices=[], usage=SCRIPT_USAGE),
    "[DONE]",
]
ARGS = '{"query": "durable streams"}'
FIRST_CALL = {"id": "call_s1", "type": "function", "function": {"name": "lookup", "arguments": ""}}
CHOICES = [  # n = 3: text, a refusal and a tool call, interleaved; each finishes on its own
    openai_chunk(delta(0, role="assistant", content="")),
    openai_chunk(delta(1, role="assistant", content=None, refusal="")),
    openai_chunk(delta(2, role="assistant", content=None)),
    openai_chunk(delta(0, content="A durable")),
    openai_chunk(delta(1, refusal="I won't")),
    openai_chunk(delta(2, tool_calls=[{"index": 0, **FIRST_CALL}])),
    openai_chunk(delta(0, content=" token stream")),
    openai_chunk(delta(2, tool_calls=[{"index": 0, "function": {"arguments": ARGS[:9]}}])),
    openai_chunk(delta(1, refusal=" answer that.")),
    openai_chunk(delta(1, "stop")),
    openai_chunk(delta(2, tool_calls=[{"index": 0, "function": {"arguments": ARGS[9:]}}])),
    openai_chunk(delta(0, content=" survives")),
    openai_chunk(delta(2, "tool_calls")),
    openai_chunk(delta(0, "length")),
    openai_chunk(choices=[], usage=SCRIPT_USAGE),
    "[DONE]",
]
EXTRAS_SCRIPT = [  # the last non-null value counts: web_search changes, then is null
    openai_chunk(delta(0, role="assistant", content="Searching"), web_search={"results": 1}),
    openai_chunk(delta(0, content=" the web"), web_search={"results": 3, "query": "q"}),
    openai_chunk(delta(0, content=" done."), web_search=None),
    openai_chunk(delta(0, "stop"), free_tier={"remaining_requests": 7}),
    openai_chunk(choices=[], usage=SCRIPT_USAGE),
    "[DONE]",
]
SCRIPTED = [
    pytest.param(
        REFUSAL,
        None,
        {"content": [""], "refusal": ["I'm sorry, but I can't help with that ✋."],
         "calls": [0], "finish_reason": ["stop"], "extras": {}},
        id="refusal",
    ),
    pytest.param(
        CHOICES,
        3,
        {"content": ["A durable token stream survives", "", ""],
         "refusal": ["", "I won't answer that.", ""], "calls": [0, 0, 1],
         "finish_reason": ["length", "stop", "tool_calls"], "extras": {}},
        id="n-3",
    ),
    pytest.param(
        EXTRAS_SCRIPT,
        None,
        {"content": ["Searching the web done."], "refusal": [""], "calls": [0],
         "finish_reason": ["stop"],
         "extras": {"web_search": {"results": 3, "query": "q"},
                    "free_tier": {"remaining_requests": 7}}},
        id="extras",
    ),
]  # fmt: skip


def outline(reply: Reply) -> dict[str, Any]:
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    assert reply["usage"] == SCRIPT_USAGE
    return {
        "content": [c["content"] for c in choices],
        "refusal": [c["refusal"] for c in choices],
        "calls": [len(c["tool_calls"]) for c in choices],
        "finish_reason": [c["finish_reason"] for c in choices],
        "extras": reply["extras"],
    }


Reply = dict[str, Any]


def choice_summary(choice: Any) -> dict[str, Any]:
    message = choice.message
    return {
        "index": choice.index,
        "role": message.role,
        "content": message.content or "",
        "refusal": message.refusal or "",
        "tool_calls": [
            (c.id, c.type, c.function.name, c.function.arguments) for c in message.tool_calls or []
        ],
        "finish_reason": choice.finish_reason,
    }


def extras_of(model: Any) -> dict[str, Any]:
    """The provider extras a chunk or a completion carries (non-null)."""
    extra = model.model_extra or {}
    return {name: extra[name] for name in EXTRAS if extra.get(name) is not None}


def summary(completion: Any, extras: dict[str, Any]) -> Reply:
    return {
        "choices": [choice_summary(choice) for choice in completion.choices],
        "usage": completion.usage.to_dict() if completion.usage else None,
        "extras": extras,
    }


class StreamReader:
    """The SDK's accumulation of a stream, and the extras its chunks carried (the last
    non-null value of each: what a client watching the chunks ends up with)."""

    def __init__(self) -> None:
        self.state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
        self.extras: dict[str, Any] = {}

    def add(self, chunk: Any) -> None:
        list(self.state.handle_chunk(chunk))
        self.extras.update(extras_of(chunk))

    def reply(self) -> Reply:
        # the snapshot, not get_final_completion(), which raises on "length" and
        # "content_filter" (tests/test_differential_openai.py pins that deviation)
        return summary(self.state.current_completion_snapshot, self.extras)


def kwargs(mock: dict[str, Any], n: int | None) -> dict[str, Any]:
    more = {} if n is None else {"n": n}
    return {
        "model": "mock-model",
        "messages": MESSAGES,
        "tools": TOOLS,
        "extra_body": {"mock": mock},
        **more,
    }


async def async_call(
    base_url: str, api_key: str, stream: bool, mock: dict[str, Any], n: int | None
) -> Reply:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        if not stream:
            completion = await client.chat.completions.create(**kwargs(mock, n))
            return summary(completion, extras_of(completion))
        reader = StreamReader()
        chunks = await client.chat.completions.create(
            **kwargs(mock, n), stream=True, stream_options=USAGE
        )
        async for chunk in chunks:
            reader.add(chunk)
        return reader.reply()


def sync_call(
    base_url: str, api_key: str, stream: bool, mock: dict[str, Any], n: int | None
) -> Reply:
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        if not stream:
            completion = client.chat.completions.create(**kwargs(mock, n))
            return summary(completion, extras_of(completion))
        reader = StreamReader()
        for chunk in client.chat.completions.create(
            **kwargs(mock, n), stream=True, stream_options=USAGE
        ):
            reader.add(chunk)
        return reader.reply()


async def call(
    flavour: str,
    base_url: str,
    api_key: str,
    stream: bool,
    mock: dict[str, Any],
    n: int | None = None,
) -> Reply:
    if flavour == "async":
        return await async_call(base_url, api_key, stream, mock, n)
    return await asyncio.to_thread(sync_call, base_url, api_key, stream, mock, n)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("mock", CASES)
async def test_the_sdk_gets_the_same_reply_through_the_gateway(
    gw: GatewayEnv, flavour: str, stream: bool, mock: dict[str, Any]
) -> None:
    direct = await call(flavour, gw.settings.upstream_url, "unused", stream, mock)
    through = await call(flavour, f"{gw.url}/v1", KEY, stream, mock)
    assert through == direct
    [choice] = direct["choices"]
    assert choice["content"] and direct["usage"]["completion_tokens"] > 0
    assert len(choice["tool_calls"]) == mock.get("tool_calls", 0)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize(("script", "n", "expected"), SCRIPTED)
async def test_refusals_choices_and_extras_arrive_as_from_the_upstream(
    gw: GatewayEnv,
    flavour: str,
    stream: bool,
    script: list[str],
    n: int | None,
    expected: dict[str, Any],
) -> None:
    mock = {"script": script}
    direct = await call(flavour, gw.settings.upstream_url, "unused", True, mock, n)
    through = await call(flavour, f"{gw.url}/v1", KEY, stream, mock, n)
    assert through == direct
    assert outline(direct) == expected  # the SDK reads the script as meant: not vacuous


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
