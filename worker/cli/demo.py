"""``chatstream demo``: the whole product on one machine with nothing but Python.

Without ``CHATSTREAM_REDIS_URL`` it uses an in-process Redis stand-in (fakeredis); without
``CHATSTREAM_UPSTREAM_URL`` (or named upstreams) it serves the mock upstream on loopback.
Set either and the same command uses the real thing; on a real Redis its keys get a prefix
of their own (``<prefix>-demo-<random>``, deleted at the end), so workers already serving
that Redis never take the demo's job. ``--gateway`` also serves the HTTP
gateway and streams the reply through it: cut off mid-reply, then resumed with
``Last-Event-ID``; then it keeps serving the page at ``/`` until interrupted.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from typing import Any

from redis.exceptions import RedisError

from worker.aio import cancel_and_wait
from worker.cli.output import print_event, print_record
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient, connect, is_fake
from worker.urls import redacted_url

DEMO_RETENTION = 600  # seconds: what a demo that did not clean up leaves behind expires

DEMO_REPLY = (
    "A durable token stream keeps every piece of a model's reply in Redis as it arrives. "
    "Any number of readers follow it live, a reader that drops resumes from the last entry "
    "id it saw, and the final message, usage and status land in the job record, so a "
    "crashed worker or a closed browser tab loses nothing."
)


async def run_demo(
    settings: Settings, message: str, *, tokens: int, rate: float, gateway: bool = False
) -> int:
    async with AsyncExitStack() as stack:
        redis = await _redis(settings)
        stack.push_async_callback(redis.aclose)
        if not is_fake(redis):
            settings = _own_prefix(settings)
            stack.push_async_callback(_forget, redis, settings.prefix)
        settings = await _upstream(stack, settings, tokens, rate)
        worker = Worker(settings, redis)
        await worker.startup()
        consume = asyncio.create_task(worker.consume())
        try:
            if gateway:
                from worker.cli.gateway_demo import through_gateway

                shown = through_gateway(stack, settings, redis, message)
            else:
                shown = _stream_one(Client.from_settings(settings, redis), message)
            return await _while_consuming(consume, shown)
        finally:
            worker.stopping.set()
            await cancel_and_wait([consume])
            await worker.shutdown()


async def _while_consuming(consume: asyncio.Task[None], shown: Coroutine[Any, Any, int]) -> int:
    """``shown``'s result; if the worker's intake ends first (it raised), its error, at once
    (the reply would otherwise wait for a worker that is gone)."""
    showing = asyncio.create_task(shown)
    await asyncio.wait((consume, showing), return_when=asyncio.FIRST_COMPLETED)
    if not showing.done():
        await cancel_and_wait([showing])
        consume.result()  # raises what ended it
        raise RuntimeError("the demo's worker stopped reading the queue")
    return showing.result()


async def _redis(settings: Settings) -> RedisClient:
    if "redis_url" in settings.model_fields_set:  # a real one: it must answer
        return await connect(settings)
    import fakeredis

    print(
        "demo: using an in-process Redis stand-in (set CHATSTREAM_REDIS_URL for a real one)",
        file=sys.stderr,
    )
    # RESP2, as real Redis gives a script's redis.call() replies whatever the client speaks
    # (fakeredis hands a script RESP3 shapes on a RESP3 connection: XREADGROUP's map)
    fake: RedisClient = fakeredis.FakeAsyncRedis(decode_responses=True, protocol=2)
    return fake


def _own_prefix(settings: Settings) -> Settings:
    """A real Redis may be shared with workers on ``CHATSTREAM_PREFIX``: the demo's job,
    worker and keys get a prefix of their own, so no other worker takes its job."""
    prefix = f"{settings.prefix}-demo-{secrets.token_hex(4)}"
    print(
        f"demo: using {redacted_url(settings.redis_url)} with a key prefix of its own, "
        f"{prefix!r}: workers on {settings.prefix!r} never see its job",
        file=sys.stderr,
    )
    return settings.model_copy(update={"prefix": prefix, "retention_seconds": DEMO_RETENTION})


async def _forget(redis: RedisClient, prefix: str) -> None:
    """The demo's keys, deleted at the end (what a failure leaves expires with its retention)."""
    try:
        keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=1000)]
        for key in keys:
            await redis.unlink(key)
    except RedisError as exc:
        print(f"demo: its keys under {prefix!r} were left to expire ({exc})", file=sys.stderr)


async def _upstream(
    stack: AsyncExitStack, settings: Settings, tokens: int, rate: float
) -> Settings:
    if "upstream_url" in settings.model_fields_set or settings.upstreams:
        return settings
    from worker.testing.mock_upstream import serve_mock

    url = await stack.enter_async_context(
        serve_mock(host="127.0.0.1", port=0, tokens=tokens, rate=rate, words=DEMO_REPLY)
    )
    print(
        f"demo: using the mock upstream at {url} (set CHATSTREAM_UPSTREAM_URL for a real one)",
        file=sys.stderr,
    )
    return settings.model_copy(update={"upstream_url": url})


async def _stream_one(client: Client, message: str) -> int:
    request = {"model": "mock-demo", "messages": [{"role": "user", "content": message}]}
    job_id = await client.enqueue(request)
    print(f"job {job_id} queued; streaming its events live:\n", flush=True)
    async for event in client.events(job_id):
        print_event(event, as_json=False)
    record = await client.get(job_id)
    print()
    print_record(record, as_json=False)
    return 0 if record.status == "succeeded" else 3
