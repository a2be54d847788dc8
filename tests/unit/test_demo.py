"""worker.cli.demo: its in-process Redis stand-in, and a worker whose intake stops."""

from __future__ import annotations

import asyncio
import time

import pytest

from worker.cli import demo
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.queue import Queue


async def test_the_stand_in_gives_scripts_what_redis_gives_them() -> None:
    """An entry already in the stream when a worker picks: the pick script reads it with
    XREADGROUP, whose reply a script gets in RESP2's shape from a real Redis. fakeredis
    gives a RESP3 client's scripts RESP3's map instead, which made the demo's worker stop
    reading (and the job wait 20 s for the stranded-entry sweep) on Python 3.12+."""
    redis = await demo._redis(Settings(_env_file=None))
    try:
        queue = Queue(redis, Keys("demo-test", 1), "w1")
        await queue.ensure_group()
        await queue.add("job-1")
        [entry] = await queue.read(1, None)
        assert entry.job_id == "job-1"
    finally:
        await redis.aclose()


async def test_the_demo_ends_at_once_with_the_error_that_stopped_its_worker() -> None:
    async def broken_intake() -> None:
        raise IndexError("list index out of range")

    async def reply_never_comes() -> int:
        await asyncio.sleep(60)
        return 0

    consume = asyncio.create_task(broken_intake())
    started = time.monotonic()
    with pytest.raises(IndexError):
        await demo._while_consuming(consume, reply_never_comes())
    assert time.monotonic() - started < 1


async def test_the_demo_returns_what_it_showed() -> None:
    async def intake() -> None:
        await asyncio.sleep(60)

    async def shown() -> int:
        return 3

    consume = asyncio.create_task(intake())
    assert await demo._while_consuming(consume, shown()) == 3
    consume.cancel()
