"""Telling a job's readers that it waits: ``waiting`` entries in its events stream.

An attempt waits without its slot (``Attempt.idle``) while its upstream is down (the gate
lets one probe at a time try it) or while the upstream's requests per minute are used up
(fleet limits). :class:`WaitingNotices` wraps that ``idle`` and writes a ``waiting`` entry
when the wait begins (an outage under ``NOTICE_AFTER`` seconds is a blip, not said),
then again only when its reason changes or after a pause that grows from ``FIRST_PAUSE``
to ``MAX_PAUSE`` seconds, and at most ``MAX_NOTICES`` per attempt: a retry tick every few
milliseconds writes nothing more. A job that stays in one wait (it is not the probe, so it
is not let out until the upstream is back) is announced again by a timer of its own. The
write is fenced like every other write of the attempt (``records/notice.lua``); a Redis
that refuses it costs the notice only, never the job. See docs/events.md and docs/decisions.md, 59.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from schemas.events import EventType
from worker.aio import cancel_and_wait
from worker.service.routing import RouteState
from worker.store.records import Records, dumps
from worker.upstream.gate import IdleSlot, monotonic

log = logging.getLogger("chatstream.pipeline")

FIRST_PAUSE = 5.0  # seconds before the same reason is said again, doubling each time
MAX_PAUSE = 60.0
MAX_NOTICES = 30  # per attempt
NOTICE_AFTER = 1.0  # seconds: an outage shorter than this (down so far + next try) is not said


@dataclass(slots=True)
class _Said:
    """What was said last in the current attempt."""

    attempt: int = 0
    reason: str = ""
    at: float = 0.0  # monotonic
    count: int = 0
    since: float = 0.0  # monotonic start of the wait of this reason


class Outage(Protocol):
    """What a job waits for: an upstream or target that is down (``UpstreamGate``), or every
    target of its route (``RouteOutage``)."""

    reason: str  # the waiting entry's reason
    down_since: float | None  # monotonic

    @property
    def last_error(self) -> str: ...

    def next_try_in(self) -> float: ...

    def where(self) -> dict[str, str]:
        """The entry's fields that say what is down (``upstream``, ``model``, ``route``)."""
        ...


class RouteOutage:
    """No target of a job's route can take it now (each down, or at its limits)."""

    reason = "targets_unavailable"

    def __init__(self, state: RouteState) -> None:
        self.state = state
        self.down_since = state.waiting_since
        failures = "; ".join(state.last_failures.values())
        self.last_error = f"route {state.name!r}: no target can take it now" + (
            f" (last failures: {failures})" if failures else ""
        )

    def next_try_in(self) -> float:
        return max(self.state.next_ask - monotonic(), 0.0)

    def where(self) -> dict[str, str]:
        return {"route": self.state.name}


class WaitingNotices:
    """The ``waiting`` entries of one job (its current attempt: ``attempt()``); ``outage()``
    says what it waits for while it waits without its slot (None: its upstream's requests
    per minute)."""

    def __init__(
        self,
        records: Records,
        job_id: str,
        outage: Callable[[], Outage | None],
        attempt: Callable[[], int],
        upstream: Callable[[], str] = lambda: "",
    ) -> None:
        self.records = records
        self.job_id = job_id
        self.outage = outage
        self.attempt = attempt
        self.upstream = upstream
        self._said = _Said()

    def around(self, idle: IdleSlot) -> IdleSlot:
        """``idle`` that announces the wait once the slot is given back."""

        @asynccontextmanager
        async def announced() -> AsyncIterator[None]:
            async with idle():
                await self.announce()
                refresh = asyncio.create_task(self._refresh())
                try:
                    yield
                finally:
                    await cancel_and_wait([refresh])

        return announced

    async def _refresh(self) -> None:
        """While one wait lasts (a job that is not the probe stays in it for the whole
        outage), announce again when due."""
        while (pause := self.next_due_in()) is not None:
            await asyncio.sleep(pause)
            await self.announce()

    def next_due_in(self) -> float | None:
        """Seconds until the next entry may be due (None: the attempt said all it may)."""
        said = self._said
        if said.attempt != self.attempt():
            return NOTICE_AFTER
        if said.count >= MAX_NOTICES:
            return None
        return max(said.at + _pause(said.count) - monotonic(), 0.1)

    async def announce(self) -> None:
        data = self.describe()
        if data is None:
            return
        try:
            await self.records.notice(
                self.job_id, self.attempt(), EventType.WAITING.value, dumps(data)
            )
        except RedisError as exc:  # the notice is lost, the job is not
            log.info("job %s: waiting entry not written (%s)", self.job_id, exc)

    def describe(self) -> dict[str, Any] | None:
        """The entry to write now, or None when it is not due."""
        outage = self.outage()
        reason = outage.reason if outage is not None else "rate_limit"
        now = monotonic()
        if outage is not None and _brief(outage, now):
            return None
        if not self._due(reason, now):
            return None
        since = outage.down_since if outage is not None else self._said.since
        waited = max(now - (since or now), 0.0)
        data: dict[str, Any] = {"reason": reason}
        if outage is not None:
            data.update(outage.where())
        else:
            data["upstream"] = self.upstream()
        data["since_ms"] = int((time.time() - waited) * 1000)
        data["for_s"] = round(waited, 1)
        if outage is not None:
            data["retry_in_s"] = round(outage.next_try_in(), 1)
            data["detail"] = outage.last_error
        else:
            data["detail"] = f"upstream {self.upstream()!r}: its requests per minute are used up"
        return data

    def _due(self, reason: str, now: float) -> bool:
        said, attempt = self._said, self.attempt()
        if said.attempt != attempt or said.reason != reason:
            self._said = _Said(attempt, reason, now, 1, now)
            return True
        if said.count >= MAX_NOTICES or now - said.at < _pause(said.count) - 0.05:
            return False
        said.at, said.count = now, said.count + 1
        return True


def _pause(said: int) -> float:
    """Seconds after the ``said``-th entry before the next: 5, 10, 20, 40, then 60."""
    return min(FIRST_PAUSE * 2.0 ** (said - 1), MAX_PAUSE)


def _brief(outage: Outage, now: float) -> bool:
    """The outage so far plus the pause before the next try is under ``NOTICE_AFTER``: a
    blip (a 503 retried at once) is not worth an entry."""
    down_for = now - (outage.down_since if outage.down_since is not None else now)
    return down_for + outage.next_try_in() < NOTICE_AFTER
