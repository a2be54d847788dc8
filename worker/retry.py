"""Retrying and backing off: tenacity everywhere, with one wait policy per kind of failure.

- Redis steps the worker retries (reading the queue, starting and settling a job, the cancel
  listener, the publisher's refused writes) pause ``REDIS_WAIT`` between tries: exponential
  from 50 ms, full jitter, capped at 2 s. Only idempotent or fenced steps are retried
  (docs/reliability.md).
- redis-py's own reconnect-and-resend (``redis_from_settings``) pauses the same way, through
  :class:`RedisBackoff`.
- Upstream calls (``worker/upstream/client.py``) retry with tenacity too; while an upstream is down
  its gate (``worker/upstream/gate.py``) paces the tries with the ``CHATSTREAM_RETRY_*`` backoff.

Loops that keep their own failure count (the publisher per job, a gate per upstream) ask
:func:`pause` for the wait that tenacity's policy gives after that many failures.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.backoff import AbstractBackoff
from redis.exceptions import RedisError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    wait_random_exponential,
)
from tenacity.wait import wait_base

log = logging.getLogger("chatstream.worker")
T = TypeVar("T")

REDIS_WAIT = wait_random_exponential(multiplier=0.05, max=2.0)
REDIS_CONNECT_WAIT = wait_random_exponential(multiplier=0.05, max=1.0)

OnFailure = Callable[[BaseException], None]


def pause(wait: wait_base, failures: int) -> float:
    """The pause ``wait`` gives after ``failures`` failures in a row."""
    state = RetryCallState(Retrying(), None, (), {})
    state.attempt_number = max(failures, 1)
    return float(wait(state))


def often_enough(failures: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th ... failure of a run: a long outage writes a few lines."""
    return failures & (failures - 1) == 0


async def retry_redis(
    what: str, call: Callable[[], Awaitable[T]], *, on_failure: OnFailure | None = None
) -> T:
    """``call()``, retried while Redis fails (until it succeeds or the task is cancelled),
    pausing ``REDIS_WAIT``; for idempotent or fenced steps only."""

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is None:
            return
        if on_failure is not None:
            on_failure(exc)
        if often_enough(state.attempt_number):
            log.warning("%s failed (%s); retrying (failure %d)", what, exc, state.attempt_number)

    async def attempt() -> T:  # a coroutine function: tenacity awaits it (not a lambda's result)
        return await call()

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(RedisError),
        wait=REDIS_WAIT,
        before_sleep=before_sleep,
        reraise=True,
    )
    return await retrying(attempt)


class RedisBackoff(AbstractBackoff):
    """redis-py's reconnect backoff, computed by tenacity's ``REDIS_CONNECT_WAIT``."""

    def __init__(self, wait: wait_base = REDIS_CONNECT_WAIT) -> None:
        self._wait = wait

    def compute(self, failures: int) -> float:
        return pause(self._wait, failures)
