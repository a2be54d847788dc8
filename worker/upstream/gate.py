"""An upstream's (or a target's) health as one worker process sees it, and the pacing of tries
while it is down.

Each upstream has a gate, and so has each target (upstream, model) jobs are sent to: a job's
try passes both. While they are up, every job calls at once. A retryable failure before the
first byte takes one down: the upstream's when it could not be reached (connection refused or
reset, TLS, DNS), the target's when it answered about that model (HTTP 408/409/425/429/5xx,
no first byte in time), so jobs for other models behind the same URL run on
(``worker.upstream.verdict``). While a gate is down:

- one job at a time tries it (a *probe*), no sooner than the pause after the previous
  failure: the upstream's ``Retry-After`` when it sent one (up to max(retry_max_backoff,
  60 s)), else exponential from ``retry_initial_backoff`` with full jitter, capped at
  ``retry_max_backoff`` (tenacity's ``wait_random_exponential``);
- every other job bound for it waits without holding a slot (``waiting``), so jobs for
  healthy upstreams keep running;
- the first answer that is not a retryable failure brings it back up and wakes every
  waiting job at once.

A job waits at most until its own ``CHATSTREAM_JOB_TIMEOUT``; see docs/decisions.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from tenacity import wait_random_exponential

from worker.errors import ChatstreamError, RetryableUpstreamError
from worker.retry import pause
from worker.upstream.verdict import Grain, grain_of

log = logging.getLogger("chatstream.upstream")

MIN_RETRY_AFTER_CAP = 60.0
MAX_MODEL_LABEL = 128  # characters of a model name in a log line

IdleSlot = Callable[[], AbstractAsyncContextManager[None]]


@asynccontextmanager
async def keep_slot() -> AsyncIterator[None]:
    """The default ``IdleSlot``: there is no slot to give back while waiting."""
    yield


def monotonic() -> float:
    """The gate's clock (a module attribute so tests can replace it)."""
    return time.monotonic()


async def wait_for_change(changed: asyncio.Event, timeout: float | None) -> None:
    """Until ``changed`` is set or ``timeout`` seconds passed (replaceable by tests)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await changed.wait()


class UpstreamGate:
    reason = "upstream_down"  # what a job waiting on it says (a ``waiting`` entry)

    def __init__(
        self, name: str, initial_backoff: float, max_backoff: float, model: str | None = None
    ) -> None:
        self.name = name  # the upstream's
        self.model = model  # a target's gate: the model its jobs ask for
        self.waiting = 0  # jobs waiting for their turn, without a slot
        self.down_since: float | None = None  # monotonic
        self.last_failure: RetryableUpstreamError | None = None
        self.failures = 0  # failed probes in a row, the failure that took it down included
        self._backoff = wait_random_exponential(multiplier=initial_backoff, max=max_backoff)
        self._retry_after_cap = max(max_backoff, MIN_RETRY_AFTER_CAP)
        self._next_try = 0.0
        self._probing = False
        self._changed = asyncio.Event()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def next_try_in(self) -> float:
        return max(self._next_try - monotonic(), 0.0) if self.down else 0.0

    def where(self) -> dict[str, str]:
        """What it guards: its upstream, and the model when it is a target's gate."""
        found = {"upstream": self.name}
        if self.model is not None:
            found["model"] = self.model
        return found

    @property
    def last_error(self) -> str:
        """The latest failure, without the upstream's name (the waiting entries give it)."""
        return "" if self.last_failure is None else _reason(self.last_failure, self.name)

    @property
    def label(self) -> str:
        """``upstream 'x'``, or ``upstream 'x' model 'y'`` (for log lines and errors)."""
        model = "" if self.model is None else f" model {self.model[:MAX_MODEL_LABEL]!r}"
        return f"upstream {self.name!r}{model}"

    @asynccontextmanager
    async def admitted(self, idle: IdleSlot, grain: Grain = Grain.UPSTREAM) -> AsyncIterator[None]:
        """Around one try: waits (in ``idle()``) for the caller's turn while what this gate
        guards is down; the try's outcome moves the gate. An upstream's gate goes down when
        it could not be reached; a target's (upstream, model) when it answered with a
        retryable failure; a failure of the other grain says nothing of this one, except
        that an upstream that answered is up."""
        probe = await self._turn(idle)
        try:
            yield
        except RetryableUpstreamError as exc:
            if grain_of(exc) is grain:
                self._failed(exc, probe)
            elif grain is Grain.UPSTREAM:
                self._up(probe)
            elif probe:
                self._probe_done()
            raise
        except ChatstreamError:  # any other upstream answer: it is up
            self._up(probe)
            raise
        except BaseException:  # cancelled, or a bug: no verdict on the upstream
            if probe:
                self._probe_done()
            raise
        self._up(probe)

    def failed(self, exc: RetryableUpstreamError) -> None:
        """A failure seen after the try was let through (an error chunk after the 200)."""
        self._failed(exc, probe=False)

    @property
    def idle(self) -> bool:
        """Up, and nobody waits on it: the gate may be forgotten."""
        return not self.down and self.waiting == 0 and not self._probing

    async def _turn(self, idle: IdleSlot) -> bool:
        """Return at once while up; while down, once the caller is the probe (True) or the
        upstream came back up (False)."""
        if not self.down:
            return False
        probe = False
        try:
            async with idle():
                self.waiting += 1
                try:
                    probe = await self._until_turn()
                finally:
                    self.waiting -= 1
        except BaseException:
            if probe:  # cancelled while taking its slot back
                self._probe_done()
            raise
        return probe

    async def _until_turn(self) -> bool:
        while self.down:
            if not self._probing and monotonic() >= self._next_try:
                self._probing = True
                return True
            timeout = None if self._probing else self._next_try - monotonic()
            await wait_for_change(self._changed, timeout)
        return False

    def _failed(self, exc: RetryableUpstreamError, probe: bool) -> None:
        now = monotonic()
        self.last_failure = exc
        if not self.down:
            self.down_since, self.failures = now, 1
            self._next_try = now + self._pause(exc)
            log.warning(
                "%s is down (%s): jobs bound for it wait; next try in %.1fs",
                self.label,
                self.last_error,
                self._next_try - now,
            )
        elif probe:
            self.failures += 1
            self._next_try = now + self._pause(exc)
            log.debug(  # no state change: the down and back lines say what operators need
                "%s still down after %.0fs (try %d: %s); next try in %.1fs, %d more jobs waiting",
                self.label,
                now - (self.down_since or now),
                self.failures,
                self.last_error,
                self._next_try - now,
                self.waiting,
            )
        elif exc.retry_after is not None:  # a late answer of a call made while it was up
            self._next_try = max(self._next_try, now + self._pause(exc))
        if probe:
            self._probe_done()

    def _pause(self, exc: RetryableUpstreamError) -> float:
        if exc.retry_after is not None:
            return min(exc.retry_after, self._retry_after_cap)
        return pause(self._backoff, self.failures)

    def _up(self, probe: bool) -> None:
        if self.down_since is not None:
            waited = self.waiting + probe  # the probe's own job waited too
            log.warning(
                "%s is back after %.1fs (%d job%s waited for it)",
                self.label,
                monotonic() - self.down_since,
                waited,
                "" if waited == 1 else "s",
            )
        self.down_since, self.failures, self._probing = None, 0, False
        self._notify()

    def _probe_done(self) -> None:
        self._probing = False
        self._notify()

    def _notify(self) -> None:
        """Wake every waiter: each looks at the gate again."""
        self._changed.set()
        self._changed = asyncio.Event()


def _reason(exc: BaseException, name: str) -> str:
    """The failure without the upstream's name, which the log line gives already."""
    text = str(exc)
    for prefix in (f"upstream {name!r}: ", f"upstream {name!r} "):
        if text.startswith(prefix):
            return text.removeprefix(prefix)
    return text
