"""What an attempt does about its upstream's fleet-wide limits once it left the queue.

The scheduler (``worker/store/scheduler.py``) lets a job out of its tenant's queue only with
a permit of its upstream and the first request of the minute's budget (and, with a
tokens-per-minute limit, its estimated tokens). What is left for the attempt:

- every further request (a retry before the first byte, the same attempt streamed again)
  takes one more of the minute's requests, waiting without its slot while there is none;
- a 429 pauses the upstream for the whole fleet (its ``Retry-After``, else
  ``DEFAULT_PAUSE``): nothing is dispatched to it, and no worker retries it, meanwhile;
- the usage the stream reports replaces the estimate in the minute's tokens.

A Redis that fails here fails open: the request goes ahead (logged), as a stream whose
publishing fails would not wait for a limit either.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.exceptions import RedisError

from worker.settings import Settings
from worker.store.queue import Entry
from worker.store.scheduler import Scheduler
from worker.upstream.gate import IdleSlot

log = logging.getLogger("chatstream.limits")

DEFAULT_PAUSE = 1.0  # seconds the fleet pauses an upstream after a 429 without Retry-After
MAX_PAUSE = 60.0


class FleetLimits:
    def __init__(self, settings: Settings, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.limits = settings.upstream_limits()

    def for_entry(
        self, entry: Entry, upstream: str, idle: IdleSlot, *, routed: bool = False
    ) -> AttemptLimits | None:
        """The attempt's side of its upstream's limits (None: the upstream has none).
        ``routed``: a route's target was just chosen for it, which took its request and
        reserved its tokens (``Scheduler.route``)."""
        limits = self.limits.get(upstream)
        if limits is None:
            return None
        counts_tokens = limits.tokens_per_minute is not None
        return AttemptLimits(self.scheduler, entry, upstream, idle, counts_tokens, routed=routed)


class AttemptLimits:
    """The ``Pacing`` of one attempt's upstream calls, and its token count at the end."""

    def __init__(
        self,
        scheduler: Scheduler,
        entry: Entry,
        upstream: str,
        idle: IdleSlot,
        counts_tokens: bool,
        *,
        routed: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.entry = entry
        self.upstream = upstream
        self.idle = idle
        scheduled = routed or entry.dispatched_at is not None
        self.counts_tokens = counts_tokens and scheduled
        self.paid = scheduled  # the dispatch (or the route's choice) took the first request

    async def before_try(self) -> None:
        if self.paid:
            self.paid = False
            return
        while (wait := await self._take_request()) > 0:
            async with self.idle():
                await asyncio.sleep(wait)

    async def _take_request(self) -> float:
        try:
            return await self.scheduler.take_request(self.entry.shard, self.upstream)
        except RedisError as exc:
            log.warning("upstream %r: requests per minute not counted (%s)", self.upstream, exc)
            return 0.0

    async def rate_limited(self, retry_after: float | None) -> None:
        pause = min(retry_after if retry_after is not None else DEFAULT_PAUSE, MAX_PAUSE)
        log.warning(
            "upstream %r answered 429: every worker pauses it for %.1fs (its limit may be "
            "lower than the one configured)",
            self.upstream,
            pause,
        )
        try:
            await self.scheduler.cool_down(self.upstream, pause)
        except RedisError as exc:
            log.warning("upstream %r: the fleet's pause not written (%s)", self.upstream, exc)

    async def spent(self, usage: Any) -> None:
        """The tokens the stream reported, in place of the estimate it was admitted on."""
        if not self.counts_tokens or not isinstance(usage, dict):
            return
        total = usage.get("total_tokens")
        if not isinstance(total, int):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if not (isinstance(prompt, int) and isinstance(completion, int)):
                return
            total = prompt + completion
        try:
            await self.scheduler.spend(self.entry.shard, self.upstream, self.entry.entry_id, total)
        except RedisError as exc:
            log.warning("upstream %r: tokens used not counted (%s)", self.upstream, exc)
