"""Routes on the worker's side: which target a started job tries, what its failures do to
the target's health for the whole fleet, and where it waits when no target can take it.

The scheduler chooses a routed job's first target when it lets the job out of its tenant's
queue (``sched/routes.lua``). Here:

- a job whose target failed before any content was published (connection refused or reset,
  TLS, no first byte in time, HTTP 408/409/429/5xx, a retryable error chunk after the 200:
  ``worker.upstream.verdict``) takes the target down for every worker (the fleet's breaker:
  ``Scheduler.trip``) and asks for the next one (``Scheduler.route``: the next that is up and
  has room, its permit moving with the job). With ``CHATSTREAM_RETRY_AFTER_OUTPUT`` the same
  holds after content, as a new attempt;
- when none can take it, the job waits without its slot (``Attempt.idle``) and asks again
  when the scheduler said one may (a cooldown ends, a limit has room), until its timeout;
- the first byte from a target brings it back up for the fleet when it was down (its probe's
  success) and keeps it known as answering (no trial needed), at most once a second per target
  and process.

A job that names no route goes on as before (``UpstreamClient``'s gates). See docs/routing.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from worker.errors import ChatstreamError, RetryableUpstreamError, UpstreamError
from worker.settings import DEFAULT_UPSTREAM, Settings
from worker.store.queue import Entry
from worker.store.scheduler import RouteEntry, Scheduler, TargetFailure
from worker.upstream.verdict import Grain, Verdict

if TYPE_CHECKING:
    from worker.service.pipeline import Attempt

log = logging.getLogger("chatstream.routing")

FRESH_SECONDS = 30.0  # a target that answered this recently needs no trial
REFRESH_SECONDS = 1.0  # how often a process says so, per target
LONGEST_WAIT = 1.0  # seconds between two asks while no target can take a job


@dataclass(frozen=True, slots=True)
class Target:
    """A route's target as a job tries it."""

    route: str
    index: int  # in the route's targets; len(targets) is its context fallback
    upstream: str
    model: str
    probe: bool = False  # the job tries it after its cooldown, for the fleet

    @property
    def key(self) -> tuple[str, str]:
        return self.upstream, self.model


@dataclass(slots=True)
class RouteState:
    """A routed job's place in its route: the current target (None: it needs one)."""

    name: str
    target: Target | None = None
    moves: int = 0
    on_context: bool = False  # it went to the route's context fallback
    waiting_since: float | None = None  # monotonic, while no target can take it
    next_ask: float = 0.0  # monotonic, when it asks again
    last_failures: dict[tuple[str, str], str] = field(default_factory=dict)


class Routing:
    """One per worker process."""

    def __init__(self, settings: Settings, scheduler: Scheduler) -> None:
        self.settings = settings
        self.routes = settings.routes
        self.scheduler = scheduler
        self._down_until: dict[tuple[str, str], float] = {}  # what this process tripped
        self._said_fresh: dict[tuple[str, str], float] = {}

    def route_of(self, upstream: str, model: object) -> str | None:
        """The route a job uses: the one it names as its upstream, or, naming the default
        upstream, the one named like its request's model."""
        if upstream in self.routes:
            return upstream
        if upstream == DEFAULT_UPSTREAM and isinstance(model, str) and model in self.routes:
            return model
        return None

    def first_target(self, entry: Entry, name: str, delivery: int) -> Target | None:
        """The target the scheduler chose with the entry, when it still stands: its first
        delivery of this route (a taken-over entry asks again: a worker may have moved it)."""
        index = entry.target
        if entry.route != name or index is None or delivery > 1:
            return None
        return self.target(name, index, probe=entry.probe)

    def target(self, name: str, index: int, *, probe: bool = False) -> Target | None:
        route = self.routes.get(name)
        if route is None:
            return None
        targets = route.all_targets()
        if not 0 <= index < len(targets):
            return None
        chosen = targets[index]
        return Target(name, index, chosen.upstream, route.target_model(chosen, name), probe)

    def locally_down(self, target: Target) -> bool:
        """This process took the target down moments ago (a job sent before that learns it
        here, without a request); its probe goes all the same."""
        until = self._down_until.get(target.key)
        return until is not None and time.monotonic() < until and not target.probe

    async def next_target(self, job: Attempt, tokens: int, *, context: bool = False) -> Target:
        """A target for the job, waiting without its slot while no target can take it."""
        state = job.route
        assert state is not None
        while True:
            choice = await self.scheduler.route(self._route_entry(job, context), tokens)
            if choice.unknown:
                raise ChatstreamError(f"route {state.name!r} is not configured here")
            if choice.target is not None:
                target = self.target(state.name, choice.target, probe=choice.probe)
                if target is not None:
                    state.waiting_since = None
                    return target
            await self._wait(job, choice.wait)

    def _route_entry(self, job: Attempt, context: bool) -> RouteEntry:
        state, entry = job.route, job.entry
        assert state is not None and entry is not None
        return RouteEntry(
            job.job_id, entry.entry_id, entry.shard, state.name, entry.permit, context
        )

    async def _wait(self, job: Attempt, wait: float) -> None:
        state = job.route
        assert state is not None
        now = time.monotonic()
        if state.waiting_since is None:
            state.waiting_since = now
        pause = LONGEST_WAIT if wait <= 0 else min(max(wait, 0.01), LONGEST_WAIT)
        state.next_ask = now + pause
        async with job.idle():
            await asyncio.sleep(pause)

    async def failed(
        self, job: Attempt, target: Target, exc: ChatstreamError, verdict: Verdict
    ) -> None:
        """The target failed the job: down for the fleet (its upstream, when unreachable)."""
        state = job.route
        assert state is not None
        state.last_failures[target.key] = str(exc)[:300]
        if verdict.grain is None:
            return
        model = "" if verdict.grain is Grain.UPSTREAM else target.model
        retry_after = exc.retry_after if isinstance(exc, RetryableUpstreamError) else None
        failure = TargetFailure(
            target.upstream,
            model,
            self.settings.breaker_cooldown,
            self.settings.breaker_max_cooldown,
            retry_after,
            _why(exc),
            job.job_id,
        )
        try:
            cooldown = await self.scheduler.trip(failure)
        except RedisError as exc_redis:  # the fleet does not learn it; this process does
            log.warning("route %r: target's failure not written (%s)", state.name, exc_redis)
            cooldown = self.settings.breaker_cooldown
        self._down_until[target.key] = time.monotonic() + cooldown
        self._said_fresh.pop(target.key, None)

    async def answered(self, target: Target) -> None:
        """The target's first byte came: up for the fleet, when it was down or is due to be
        said fresh again."""
        now = time.monotonic()
        was_down = self._down_until.pop(target.key, None) is not None
        said = self._said_fresh.get(target.key, 0.0)
        if not (target.probe or was_down or now - said >= REFRESH_SECONDS):
            return
        self._said_fresh[target.key] = now
        try:
            healed = await self.scheduler.heal(
                target.upstream, target.model, int(FRESH_SECONDS * 1000)
            )
        except RedisError as exc:
            log.info("route %r: target's answer not written (%s)", target.route, exc)
            return
        if healed:
            log.warning(
                "route %r: target %s answered again; it is back in rotation",
                target.route,
                _label(target),
            )


def _why(exc: ChatstreamError) -> str:
    status = exc.status if isinstance(exc, UpstreamError) else None
    return f"HTTP {status}: {exc}" if status is not None else str(exc)


def _label(target: Target) -> str:
    return f"{target.upstream!r} model {target.model!r}"
