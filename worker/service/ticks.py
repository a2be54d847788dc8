"""Wake-up coalescing: while jobs run, the event loop polls at most once per tick.

At one upstream event per read, a lightly loaded worker wakes up for nearly every token:
each read, each Redis reply and each pacing timer arrives on its own, and on a VM a
wake-up from idle (the sleep, the context switch back, cold caches) costs more CPU than
the token's own work (docs/decisions.md, 60). :class:`WakeCoalescer` keeps one callback
in the loop's ready queue while jobs run: it ends each pass of the loop by sleeping out
what is left of the tick, so everything that arrived meanwhile (reads of many streams,
the publisher's reply, due timers) is handled in one wake-up. A pass that took the whole
tick (a busy loop) sleeps not at all, so at high load nothing changes; when no job runs,
the callback stops and the loop blocks in its poll as before. What it costs: a read or a
timer waits at most one tick longer before it is handled.

Only the reads of running streams and the publisher's replies that nothing waits for are
meant to wait: the sleep is an ``epoll_wait`` on ``worker.aio.URGENT``, the sockets whose
news must not (Redis connections, the publisher's while entries wait for its reply, an
upstream connection until its first token, the embedded HTTP servers' sockets), so a job's
start, its end, a cancel or a request ends the sleep at once (docs/decisions.md, 68); on
asyncio's own loop a due timer ends it too.
Elsewhere than Linux the sleep is ``time.sleep``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from worker import internals
from worker.aio import URGENT
from worker.settings import Settings

EMPTY_PASS = 15e-6  # a pass of the loop shorter than this ran nothing but its poll
log = logging.getLogger("chatstream.worker")


def tick_seconds(settings: Settings) -> float:
    """The tick a worker runs with: ``CHATSTREAM_WAKE_TICK_MS``, or 0 (off) where the set of
    urgent sockets cannot work: no epoll (macOS, Windows: said in one line), or redis-py
    hides the sockets of its connections (``worker.internals`` said which). Without the
    set every dependent hop would wait for the tick (decision 67's 12 ms configuration:
    a job's first token about 61 ms later instead of 23), so no tick at all is the honest
    fallback: the loop wakes for each read, as before decision 60 (decision 81)."""
    seconds = settings.wake_tick_ms / 1000
    if seconds <= 0:
        return 0.0
    if not URGENT.possible():
        log.info("no epoll on %s: the wake-up tick is off (docs/scaling.md)", sys.platform)
        return 0.0
    sockets_shown = internals.available("redis-connect-hook") and internals.available(
        "redis-connection-writer"
    )
    return seconds if sockets_shown else 0.0


class WakeCoalescer:
    def __init__(
        self,
        tick: float,
        active: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = URGENT.sleep,
    ) -> None:
        """``tick`` seconds (0: off); ``active()`` says whether jobs run (else it stops).
        ``clock`` and ``sleep`` are the blocking ones (tests pass fakes)."""
        self._tick = tick
        self._active = active
        self._clock = clock
        self._sleep = sleep
        self._handle: asyncio.Handle | None = None
        self._ran_at = 0.0  # monotonic time at which the previous pass's callback returned
        self._tick_began = 0.0  # ... at which the last sleep ended
        self._quiet = False  # the previous pass was a quiet one too
        self.sleeps = 0  # how often the loop was put to sleep (tests)

    def resume(self) -> None:
        """Start pacing the loop (idempotent); called whenever a job starts."""
        if self._tick > 0 and self._handle is None:
            self._ran_at = self._tick_began = self._clock()
            self._handle = asyncio.get_running_loop().call_soon(self._pace)

    @property
    def on(self) -> bool:
        return self._tick > 0

    @property
    def running(self) -> bool:
        return self._handle is not None

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _pace(self) -> None:
        """Once per pass of the loop: sleep out the tick when the loop has gone idle.

        The callback re-queues itself, so the loop never blocks in its poll; a pass in
        which nothing but this callback ran (a chain of wake-ups, read -> fold -> publish
        -> the round trip's write, has ended) is when the loop would block: it sleeps
        there instead, until one tick after the previous sleep ended."""
        if not self._active():
            self._handle = None
            return
        now = self._clock()
        loop = asyncio.get_running_loop()
        if self._idle(loop, now):
            wait = min(self._tick_began + self._tick - now, _next_timer_in(loop))
            if wait > 0:
                self._sleep(wait)
                self.sleeps += 1
                now = self._clock()
            if now >= self._tick_began + self._tick:  # (else news woke it: the tick goes on)
                self._tick_began = now
            self._quiet = False  # what woke it runs before the next sleep
        self._handle = loop.call_soon(self._pace)
        self._ran_at = self._clock()

    def _idle(self, loop: asyncio.AbstractEventLoop, now: float) -> bool:
        """Nothing but this callback to run: nothing queued behind it where the loop shows
        its queue; else two passes in a row that took next to no time, the pass a sleep
        ended not counted (what woke the loop may be queued behind this callback)."""
        ready = _queue_of(loop)
        if ready is not None:
            return not ready
        quiet = now - self._ran_at < EMPTY_PASS
        was_quiet, self._quiet = self._quiet, quiet
        return quiet and was_quiet


# asyncio's own loop shows what it will run: the callbacks queued behind this one in the
# pass (``_ready``: the reads its poll just found, the timers just due) and its timers
# (``_scheduled``). With them the coalescer sleeps only when nothing is queued, and not
# past the next timer. uvloop shows neither: what its poll found runs before the queued
# callbacks but may queue more behind this one, hence ``_idle``'s two quick passes; its
# timers fire up to a tick late (a pause that matters is taken under ``URGENT.hurry``).


def _shows_queues(loop: asyncio.AbstractEventLoop) -> bool:
    """asyncio's own loop, whose ready queue and timers are where this module reads them
    (not uvloop, nor an asyncio that keeps them elsewhere now: ``worker.internals``)."""
    return isinstance(loop, asyncio.BaseEventLoop) and internals.available("asyncio-loop-queues")


def _queue_of(loop: asyncio.AbstractEventLoop) -> Any:
    """asyncio's ready queue (None: not shown)."""
    return getattr(loop, "_ready", None) if _shows_queues(loop) else None


def _next_timer_in(loop: asyncio.AbstractEventLoop) -> float:
    """Seconds until the loop's next timer is due (``inf``: none, or not shown)."""
    if not _shows_queues(loop):
        return math.inf
    scheduled = getattr(loop, "_scheduled", None)
    if not scheduled:
        return math.inf
    return float(scheduled[0].when()) - loop.time()
