"""Redis over TLS (``rediss://``): the worker and the client in process.

A dedicated redis-server listens only on a TLS port (``--port 0``) with a certificate
signed by a throw-away CA the test generates (``cryptography``; ``tests/helpers/tls.py``).
The CA reaches redis-py through the URL query (``?ssl_ca_certs=...``): no code path needs
anything else. The CLI over TLS is in ``tests/system/test_tls.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from schemas.events import EventType
from tests.helpers.harness import chat
from tests.helpers.tls import PASSWORD, TLSSetup
from worker.testing.mock_upstream import expected_reply


async def test_worker_and_client_work_over_tls(tls: TLSSetup) -> None:
    assert tls.redis.connection_pool.connection_kwargs["ssl_ca_certs"] == str(tls.server.certs.ca)
    request = chat("over tls")
    job_id = await tls.client.enqueue(request)
    assert await tls.worker.run_burst() == 1
    record = await tls.client.result(job_id, timeout=5)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, tls.mock.config)
    events = [event async for event in tls.client.events(job_id)]
    assert events[-1].type is EventType.DONE


async def test_cancel_over_tls_uses_pubsub(tls: TLSSetup) -> None:
    job_id = await tls.client.enqueue(chat("slow", tokens=400, rate=20.0))
    burst = asyncio.create_task(tls.worker.run_burst())
    async with asyncio.timeout(5):
        async for event in tls.client.events(job_id, block_ms=100):
            if event.type is EventType.DELTA:
                break
    assert await tls.client.cancel(job_id) == "requested"
    async with asyncio.timeout(2):  # the pub/sub message, not the 1.7 s flag poll
        await tls.mock.disconnected.wait()
    await burst
    assert (await tls.client.get(job_id)).status == "cancelled"


async def test_tls_without_the_ca_or_with_another_ca_is_refused(tls: TLSSetup) -> None:
    for ca in (None, tls.server.certs.other_ca):
        redis = Redis.from_url(tls.server.url_with(ca))
        with pytest.raises(RedisConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await redis.ping()
        await redis.aclose()


async def test_plain_redis_to_the_tls_port_is_refused(tls: TLSSetup) -> None:
    redis = Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{tls.server.port}/0")
    with pytest.raises(RedisConnectionError):
        await redis.ping()
    await redis.aclose()
