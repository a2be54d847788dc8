"""``chatstream demo --gateway``: the reply through the HTTP gateway, cut off and resumed.

The gateway serves on ``CHATSTREAM_GATEWAY_HOST:CHATSTREAM_GATEWAY_PORT`` with a fresh
random API key (added to any configured ones). The demo posts the request as an OpenAI
client would (``stream: true``), drops the connection after a few events, resumes with
``Last-Event-ID``, and then serves the page until SIGINT (exit status 130, as every
interrupted command) or SIGTERM (0, or 3 when the reply did not finish).
"""

from __future__ import annotations

import json
import secrets
import signal
import sys
from contextlib import AsyncExitStack

import httpx
from httpx_sse import EventSource
from pydantic import SecretStr

from worker.settings import Settings
from worker.store.redis_client import RedisClient

CUT_AFTER_EVENTS = 12


async def through_gateway(
    stack: AsyncExitStack, settings: Settings, redis: RedisClient, message: str
) -> int:
    from worker.gateway.server import serve_gateway, until_signalled

    key = secrets.token_urlsafe(18)
    configured = settings.gateway_api_keys.get_secret_value() if settings.gateway_api_keys else ""
    keys = SecretStr(f"{configured},{key}" if configured else key)
    settings = settings.model_copy(update={"gateway_api_keys": keys})
    url = await stack.enter_async_context(serve_gateway(settings, redis))
    print(f"demo: the gateway is at {url} (API key {key})", file=sys.stderr)
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        job_id, last_id = await _first_part(http, message)
        print(f"\n[connection dropped after {CUT_AFTER_EVENTS} events; resuming]", flush=True)
        finished = await _rest(http, job_id, last_id)
    print(f"\nopen {url}/#key={key}&model=mock-demo in a browser; Ctrl-C stops", flush=True)
    if await until_signalled() == signal.SIGINT:
        return 130
    return 0 if finished else 3


async def _first_part(http: httpx.AsyncClient, message: str) -> tuple[str, str]:
    request = {
        "model": "mock-demo",
        "messages": [{"role": "user", "content": message}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    print("POST /v1/chat/completions (stream: true)", flush=True)
    async with http.stream("POST", "/v1/chat/completions", json=request) as response:
        response.raise_for_status()
        job_id = response.headers["x-chatstream-job-id"]
        print(f"job {job_id}; its OpenAI chunks, live:\n", flush=True)
        seen = 0
        async for event in EventSource(response).aiter_sse():
            _show(event.data)
            seen += 1
            if seen == CUT_AFTER_EVENTS:
                return job_id, event.id
    raise RuntimeError("the reply ended before the demo cut it")


async def _rest(http: httpx.AsyncClient, job_id: str, last_id: str) -> bool:
    print(f"GET /v1/jobs/{job_id}/events with Last-Event-ID: {last_id}\n", flush=True)
    headers = {"last-event-id": last_id}
    finished = False
    async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        response.raise_for_status()
        async for event in EventSource(response).aiter_sse():
            finished = finished or event.data == "[DONE]"
            _show(event.data)
    return finished


def _show(data: str) -> None:
    if data == "[DONE]":
        print("\n[done]", flush=True)
        return
    chunk = json.loads(data)
    for choice in chunk.get("choices", []):
        print(choice["delta"].get("content") or "", end="", flush=True)
    if chunk.get("usage"):
        print(f"\n[usage {json.dumps(chunk['usage'])}]", end="", flush=True)
    if chunk.get("error"):
        print(f"\n[error: {chunk['error']['message']}]", flush=True)
