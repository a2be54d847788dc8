"""A running gateway for the gateway tests: a real redis-server, the mock upstream, an
in-process worker consuming live, and the gateway served by uvicorn on loopback; SSE
reading, and upstream chunks scripted in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent
from pydantic import SecretStr

from worker.aio import cancel_and_wait
from worker.client import Client
from worker.gateway import serve_gateway
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockUpstream

KEY = "sk-gateway-test-one"
OTHER_KEY = "sk-gateway-test-two"  # configured as its SHA-256 only


def key_setting(*plain: str, hashed: tuple[str, ...] = ()) -> SecretStr:
    entries = [*plain, *(f"sha256:{hashlib.sha256(k.encode()).hexdigest()}" for k in hashed)]
    return SecretStr(",".join(entries))


@dataclass
class GatewayEnv:
    url: str
    settings: Settings
    redis: RedisClient
    mock: MockUpstream
    client: Client
    worker: Worker | None

    def http(self, key: str | None = KEY, **headers: str) -> httpx.AsyncClient:
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)


@asynccontextmanager
async def running_gateway(
    settings: Settings,
    redis: RedisClient,
    mock: tuple[MockUpstream, str],
    *,
    worker: bool = True,
    **updates: Any,
) -> AsyncIterator[GatewayEnv]:
    app, upstream_url = mock
    defaults: dict[str, Any] = {
        "upstream_url": upstream_url,
        "gateway_api_keys": key_setting(KEY, hashed=(OTHER_KEY,)),
        "gateway_keepalive_seconds": 1.0,
    }
    settings = settings.model_copy(update={**defaults, **updates})
    running: Worker | None = None
    consume: list[asyncio.Task[None]] = []
    if worker:
        running = Worker(settings, redis)
        await running.startup()
        consume.append(asyncio.create_task(running.consume()))
    try:
        async with serve_gateway(settings, redis, host="127.0.0.1", port=0) as url:
            client = Client.from_settings(settings, redis)
            yield GatewayEnv(url, settings, redis, app, client, running)
    finally:
        if running is not None:
            running.stopping.set()
            await cancel_and_wait(consume)
            await running.shutdown()


async def sse_events(response: httpx.Response) -> AsyncIterator[ServerSentEvent]:
    """The events of a streaming response, as an independent client (httpx-sse) reads them."""
    async for event in EventSource(response).aiter_sse():
        yield event


def parse_frames(frames: bytes | str) -> list[ServerSentEvent]:
    """The events of SSE frames, as httpx-sse reads them."""
    headers = {"content-type": "text/event-stream"}
    return list(EventSource(httpx.Response(200, content=frames, headers=headers)).iter_sse())


def chunks_of(events: list[ServerSentEvent]) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in events if e.data != "[DONE]"]


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for chunk in chunks
        for choice in chunk.get("choices", [])
    )


async def collect(response: httpx.Response) -> list[ServerSentEvent]:
    return [event async for event in sse_events(response)]


# -- scripted upstream streams, shaped like OpenAI's (for ``mock.script``) ------------------


def openai_chunk(*choices: dict[str, Any], **top: Any) -> str:
    body = {
        "id": "chatcmpl-script",
        "object": "chat.completion.chunk",
        "created": 1751299200,
        "model": "mock-model",
        "service_tier": "default",
        "system_fingerprint": "fp_script",
        "choices": list(choices),
        "usage": None,
        "obfuscation": "Xk2",
        **top,
    }
    return json.dumps(body, ensure_ascii=False)


def delta(index: int, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "logprobs": None, "finish_reason": finish}


SCRIPT_USAGE = {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
