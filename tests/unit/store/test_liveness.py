"""Who may judge (worker/store/liveness.py): a worker declares others dead only after its
own heartbeats have been on time for the whole timeout, on the session's redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from worker.store.keys import Keys
from worker.store.liveness import Liveness
from worker.store.redis_client import RedisClient

TIMEOUT = 0.5
ON_TIME = TIMEOUT / 10  # between two beats


async def silent_worker(redis: RedisClient, keys: Keys) -> None:
    await redis.zadd(keys.workers, {"silent": time.time() - 600})


async def beat_on_time(liveness: Liveness, seconds: float) -> list[str]:
    """Beats every ``ON_TIME`` for ``seconds``; who the last one found dead."""
    began = time.monotonic()
    while True:
        found = (await liveness.beat()).dead
        if time.monotonic() - began >= seconds:
            return found
        await asyncio.sleep(ON_TIME)


def hang_once(liveness: Liveness, seconds: float) -> None:
    """The next beat hangs ``seconds`` before it reaches Redis, then succeeds (a command
    redis-py got through after a partition)."""
    script: Callable[..., Awaitable[Any]] = liveness._beat

    async def hung(**kwargs: Any) -> Any:
        await asyncio.sleep(seconds)
        liveness._beat = script  # type: ignore[assignment]
        return await script(**kwargs)

    liveness._beat = hung  # type: ignore[assignment]


async def test_a_worker_judges_once_its_beats_were_on_time_for_the_timeout(
    redis: RedisClient, prefix: str
) -> None:
    keys = Keys(prefix)
    liveness = Liveness(redis, keys, "w", TIMEOUT)
    await silent_worker(redis, keys)
    assert (await liveness.beat()).dead == []
    assert await beat_on_time(liveness, TIMEOUT * 1.2) == ["silent"]


async def test_a_beat_that_hung_longer_than_the_timeout_is_a_break(
    redis: RedisClient, prefix: str
) -> None:
    keys = Keys(prefix)
    liveness = Liveness(redis, keys, "w", TIMEOUT)
    await silent_worker(redis, keys)
    assert await beat_on_time(liveness, TIMEOUT * 1.2) == ["silent"]
    hang_once(liveness, TIMEOUT * 1.5)
    assert (await liveness.beat()).dead == []  # it succeeded, but late: no judging
    assert await beat_on_time(liveness, TIMEOUT * 0.5) == []
    assert await beat_on_time(liveness, TIMEOUT * 0.7) == ["silent"]


async def test_a_gap_between_successful_beats_is_a_break(redis: RedisClient, prefix: str) -> None:
    keys = Keys(prefix)
    liveness = Liveness(redis, keys, "w", TIMEOUT)
    await silent_worker(redis, keys)
    assert await beat_on_time(liveness, TIMEOUT * 1.2) == ["silent"]
    await asyncio.sleep(TIMEOUT * 1.5)  # its event loop stalled, say
    assert (await liveness.beat()).dead == []
    assert await beat_on_time(liveness, TIMEOUT * 1.2) == ["silent"]


async def test_a_failed_beat_is_a_break(redis: RedisClient, prefix: str) -> None:
    keys = Keys(prefix)
    liveness = Liveness(redis, keys, "w", TIMEOUT)
    await silent_worker(redis, keys)
    assert await beat_on_time(liveness, TIMEOUT * 1.2) == ["silent"]
    script = liveness._beat

    async def refused(**kwargs: Any) -> Any:
        raise ConnectionError("cut off")

    liveness._beat = refused  # type: ignore[assignment]
    with pytest.raises(ConnectionError):
        await liveness.beat()
    liveness._beat = script
    assert (await liveness.beat()).dead == []
