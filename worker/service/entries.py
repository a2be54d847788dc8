"""What becomes of a queue entry the worker held: acked, left, handed back or requeued.

``HeldEntry`` is the worker's bookkeeping for one entry it holds (its task, whether it holds
a slot, whether its lease was lost). ``EntryFate`` decides the entry's end once its attempt
is over (or never started), from what the start script or the record says: every step is
idempotent or fenced, so the worker retries them through Redis outages. docs/reliability.md
says why each case ends as it does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from redis.exceptions import RedisError

from schemas.jobs import TERMINAL
from worker import logs
from worker.service.metrics import Metrics
from worker.service.pipeline import Attempt, Outcome, log_failure
from worker.store.keys import Keys
from worker.store.queue import Entry, Queue
from worker.store.records import Records, Started
from worker.store.replication import Replication

log = logging.getLogger("chatstream.worker")
TERMINAL_STATUSES = frozenset(status.value for status in TERMINAL)


@dataclass(slots=True)
class HeldEntry:
    """A queue entry this worker holds, and the task that runs it."""

    entry: Entry
    task: asyncio.Task[None]
    job: Attempt | None = None  # set once the attempt started
    lost: bool = False  # its lease went to another worker
    claimed: bool = False  # checked still ours and fresh (claim_for_start): renewed from then
    holds_slot: bool = False
    waiting: bool = False  # for a down upstream, without its slot
    settling: bool = False  # its entry is being acked or handed back (gone on purpose)


class EntryFate:
    """The end of a held entry: ack it, leave it to a newer delivery, requeue it."""

    def __init__(
        self,
        queue: Queue,
        records: Records,
        replication: Replication,
        keys: Keys,
        metrics: Metrics,
    ) -> None:
        self.queue = queue
        self.records = records
        self.replication = replication
        self.keys = keys
        self.metrics = metrics

    async def skip(self, entry: Entry, started: Started) -> None:
        """An entry whose attempt did not start: the start script said why."""
        job_id = entry.job_id or ""
        if started.state == "superseded":
            log.warning(
                "job %s: entry %s was delivered again since; the newer delivery runs it",
                job_id,
                entry.ref,
            )
            return  # not ours to ack
        self._log_unstarted(job_id, entry, started)
        if started.dead_pending:
            await self.dead_letter(job_id, started.attempt)
        if started.state in ("terminal", "exhausted", "invalid"):
            await self.ack_ended(entry, job_id)
        else:
            await self.queue.ack(entry)

    def _log_unstarted(self, job_id: str, entry: Entry, started: Started) -> None:
        if started.state == "missing":
            log.error("job %s has no record (expired or never created); dropping", job_id)
            self.metrics.job_missing()
        elif started.state == "busy":
            log.warning("job %s runs under another queue entry; dropping %s", job_id, entry.ref)
        elif started.state in ("exhausted", "invalid"):  # failed by the start script
            logs.set_attempt(started.attempt)
            error = json.loads(started.error)
            log_failure(job_id, started.attempt, started.upstream, error)
            code = str(error.get("code", "error")) if isinstance(error, dict) else "error"
            self.metrics.job_failed_unstarted(entry.tenant, started.upstream, code)

    async def settle(self, held: HeldEntry, job: Attempt, outcome: Outcome) -> None:
        """An entry whose attempt ran: ack it, requeue it (released) or check the record."""
        if outcome is Outcome.FINISHED and job.replicated:
            await self.queue.ack(held.entry)
        elif outcome is Outcome.FINISHED:
            self._leave_unreplicated(job.job_id)
        elif outcome is Outcome.RELEASED and not held.lost:
            if await self.records.release(job.job_id, job.attempt):
                await self.requeue(held.entry, job.job_id)
        else:  # STALE or lost: a newer attempt owns the job, it ended, or its record is gone
            await self._close_if_ended(held.entry, job)

    async def _close_if_ended(self, entry: Entry, job: Attempt) -> None:
        """Ack the entry of a job that reached a terminal state (a retried terminal write
        finds its own first write); leave it alone while a newer attempt runs. A record
        behind this attempt (Redis lost writes in a failover) is queued again."""
        job_id, attempt = job.job_id, job.attempt
        status, dead_pending, current = await self.records.closing_state(job_id)
        if dead_pending:
            await self.dead_letter(job_id, attempt)
        if status in ("running", "queued") and (job.stream.rolled_back or current < attempt):
            await self._rerun_after_loss(entry, job_id, attempt)
        elif status == "missing":
            log.error("job %s: its record is gone (expired, or lost by Redis); dropping", job_id)
            self.metrics.job_missing()
            await self.queue.ack(entry)
        elif status in TERMINAL_STATUSES:
            await self.ack_ended(entry, job_id)

    async def ack_ended(self, entry: Entry, job_id: str) -> None:
        """Ack the entry of a job whose record is terminal; with replicas to wait for, only
        once they have that terminal state (else the entry stays, to be checked again by
        whoever reclaims it after the lease)."""
        if self.replication.enabled and not await self.replication.terminal_replicated(
            self.keys.job(job_id)
        ):
            self._leave_unreplicated(job_id)
            return
        await self.queue.ack(entry)

    def _leave_unreplicated(self, job_id: str) -> None:
        log.warning(
            "job %s: fewer than %d replicas acknowledged its terminal state within %d ms; its "
            "queue entry stays and is checked again after the lease",
            job_id,
            self.replication.replicas,
            self.replication.timeout_ms,
        )

    async def dead_letter(self, job_id: str, attempt: int) -> None:
        reason = {"code": "attempts_exhausted", "attempts": attempt}
        dead_entry = await self.queue.dead_letter(job_id, reason)
        await self.records.dead_lettered(job_id, dead_entry)

    async def _rerun_after_loss(self, entry: Entry, job_id: str, attempt: int) -> None:
        """The job back to the queue: its record is behind what this attempt wrote."""
        state = await self.records.rolled_back(job_id, attempt)
        if state != "queued":  # a newer attempt started since, or the job ended
            log.info(
                "job %s: Redis lost writes of attempt %d; the job is %s", job_id, attempt, state
            )
            return
        log.warning("job %s: Redis lost writes of attempt %d; requeued", job_id, attempt)
        if await self.queue.requeue(entry, job_id) is None and not await self.queue.job_of(entry):
            entry_id = await self.queue.add(job_id)  # the queue lost our entry too
            await self.records.mark_queued(job_id, entry_id)

    async def requeue(self, entry: Entry, job_id: str) -> None:
        if await self.queue.requeue(entry, job_id) is None:
            log.info("job %s: entry %s was taken over; not requeued", job_id, entry.ref)

    async def hand_back_unstarted(self, max_idle_ms: int) -> None:
        """Hand back the entries we hold but no longer run: reads cut short by shutdown,
        starts cancelled midway, tasks that died. Only entries idle less than
        ``max_idle_ms``: older ones may be being taken over right now, and reclaim does that
        anyway."""
        try:
            for entry in await self.queue.owned(max_idle_ms=max_idle_ms):
                job_id = await self.queue.job_of(entry)
                if job_id is None:
                    await self.queue.ack(entry)
                    continue
                await self.records.hand_back(job_id, entry.ref)
                await self.requeue(entry, job_id)
        except RedisError as exc:
            log.warning("could not hand back pending entries: %s", exc)
