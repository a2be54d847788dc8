"""Coalescing, pipelined publishing of every in-flight job's events, gapless per job.

Deltas are handed to :meth:`Publisher.publish` without waiting. One flusher task writes what
is due for *all* jobs in one pipelined round trip, then looks again: at low load a delta goes
out at once (no fixed delay); at high load the deltas that arrive while a round trip is in
flight are merged per job into its next entry, so round trips stay few and a delta waits at
most about one round trip.

**Per job, the events stream is gapless and in order, whatever subset of a pipeline Redis
refuses** (OOM at maxmemory, READONLY after a failover, BUSY, NOSCRIPT, a lost connection).
The whole rule lives in :class:`JobStream` and the two scripts it calls:

- each delta entry of an attempt gets the next sequence number when it is first sent, and
  keeps it (and its content) until Redis confirms it; the delta script writes it only right
  after the previous number (else ``NOT_YET``) and never twice (``ALREADY``);
- the terminal write carries the attempt's last number and waits (``NOT_YET``) until the
  record reached it, so it never lands before a delta;
- whatever was not confirmed is sent again, in order, on the job's next round trip, after a
  pause that grows while Redis keeps refusing that job (``worker.retry.REDIS_WAIT``); other
  jobs are not held back. Writes are retried until they land or the attempt is over.

A write the fence refuses (``STALE``: a newer attempt owns the job, or the record is gone)
marks the attempt stale: nothing more is written for it, and the pipeline stops it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from worker.aio import URGENT, cancel_and_wait
from worker.protocol.accumulator import Delta
from worker.retry import REDIS_WAIT, pause
from worker.store.batch import BatchSender, Command
from worker.store.cluster_batch import default_sender
from worker.store.records import ALREADY, NOT_YET, STALE, WRITTEN, Records, dumps
from worker.store.redis_client import RedisClient
from worker.store.replication import Replication

log = logging.getLogger("chatstream.publisher")

WARN_EVERY = 10.0  # seconds between warnings while Redis keeps refusing writes
ROUND_TRIP_EVERY = 0.002  # under load, at most one round trip per this many seconds
# A round trip's reply ends the wake-up tick's sleep (worker.aio.URGENT) when something
# waits for it: entries handed over while it is in flight (the next round trip's: a job's
# first token, or a busy loop's next batch), or a terminal entry it carries (the job's end
# waits for it). Else the reply waits for the tick, with the reads it shares the wake-up with.
DELTA, TERMINAL = "delta", "terminal"


@dataclass(slots=True)
class Terminal:
    """The terminal write: record fields plus the closing event, applied atomically."""

    event_type: str
    event_data: dict[str, Any]
    fields: dict[str, str]
    done: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    replicated: bool = True  # False: written, but fewer replicas than wanted have it


@dataclass(slots=True)
class JobStream:
    """One attempt's publishing state: what is still to write, in order."""

    job_id: str
    attempt: int
    pending: Delta | None = None  # deltas not numbered yet, merged into one entry
    unconfirmed: list[tuple[int, str]] = field(default_factory=list)  # (seq, data), in order
    seq: int = 0  # the last number given
    confirmed: int = 0  # the last number Redis confirmed (entries land in order)
    terminal: Terminal | None = None
    stale: bool = False
    rolled_back: bool = False  # Redis lost entries it had confirmed (a failover): rerun
    refusals: int = 0  # round trips in a row in which Redis refused a write of this job
    due: float = 0.0  # loop time of its next round trip (after a refusal)

    def take_ops(self) -> list[tuple[int, str]]:
        """The entries to send, oldest first: the unconfirmed ones and the pending delta
        (numbered now; from here on its number and content are fixed)."""
        if self.pending is not None:
            self.seq += 1
            self.unconfirmed.append((self.seq, dumps(self.pending.to_json())))
            self.pending = None
        return list(self.unconfirmed)

    def settle_delta(self, seq: int, result: int) -> bool:
        """Apply the delta script's answer; True when the entry must be sent again."""
        if result in (WRITTEN, ALREADY):
            self.unconfirmed = [op for op in self.unconfirmed if op[0] != seq]
            self.confirmed = max(self.confirmed, seq)
            return False
        if result == STALE:
            self.stale = True
            return False
        if result == NOT_YET and seq == self.confirmed + 1:
            self.roll_back()  # the record is behind an entry Redis confirmed
            return False
        return result == NOT_YET

    def roll_back(self) -> None:
        """Redis lost writes of this attempt it had confirmed: nothing more is written; the
        runner reruns the job as a new attempt."""
        self.stale = self.rolled_back = True

    def settle_terminal(self, result: int) -> bool:
        """Apply the terminal script's answer; True when it must be sent again."""
        assert self.terminal is not None
        if result == NOT_YET and not self.stale and self.unconfirmed:
            return True  # a delta entry is still missing: it goes first
        if result == NOT_YET and not self.stale:
            self.roll_back()  # every delta was confirmed, yet the record lacks one
        if not self.terminal.done.done():
            self.terminal.done.set_result(WRITTEN if result == WRITTEN and not self.stale else 0)
        return False

    def drop(self) -> None:
        """The attempt is over for the publisher (stale): nothing more is written."""
        self.pending, self.unconfirmed = None, []
        if self.terminal is not None and not self.terminal.done.done():
            self.terminal.done.set_result(0)


BatchObserver = Callable[[int, float], None]
Op = tuple[JobStream, str, int]


class Publisher:
    def __init__(
        self,
        redis: RedisClient,
        records: Records,
        max_batch: int = 1000,
        on_batch: BatchObserver | None = None,
        sender: BatchSender | None = None,
        round_trip_every: float = ROUND_TRIP_EVERY,
        replication: Replication | None = None,
    ) -> None:
        self._records = records
        self._replication = replication if replication and replication.enabled else None
        self._sender = sender if sender is not None else default_sender(redis)
        self._round_trip_every = round_trip_every
        self._not_before = 0.0  # loop time before which no round trip begins
        self._max_batch = max_batch
        self._on_batch = on_batch
        self._dirty: dict[tuple[str, int], JobStream] = {}
        self._wake = asyncio.Event()
        self._round_trip_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._refused = 0  # writes refused since the last warning
        self._warned_at: float | None = None
        self._in_flight = False  # a round trip was sent and its replies are not all read
        self._expedited = False  # ... and its replies end the tick's sleep

    def open(self, job_id: str, attempt: int) -> JobStream:
        return JobStream(job_id, attempt)

    def publish(self, stream: JobStream, delta: Delta) -> None:
        """Queue a delta; it is merged into the job's pending entry if one is waiting."""
        if stream.stale:
            return
        if stream.pending is None:
            stream.pending = delta
        else:
            stream.pending.merge(delta)
        self._mark(stream)

    async def finish(self, stream: JobStream, terminal: Terminal) -> bool:
        """Write pending deltas then the terminal entry; False when the attempt is stale.

        With replicas to wait for, the terminal write goes on the replication's connection,
        once every delta landed, followed by ``WAIT`` (``terminal.replicated`` says whether
        enough replicas acknowledged it)."""
        if stream.stale:
            return False
        if self._replication is not None:
            return await self._finish_replicated(stream, terminal, self._replication)
        stream.terminal = terminal
        self._mark(stream)
        return await asyncio.shield(terminal.done) == WRITTEN

    async def _finish_replicated(
        self, stream: JobStream, terminal: Terminal, replication: Replication
    ) -> bool:
        await self.flush(stream)
        failures = 0
        while not stream.stale:
            args = self._terminal_args(terminal)
            command = self._records.finish_command(stream.job_id, stream.attempt, stream.seq, args)
            try:
                result, acked = await replication.send(
                    self._records.keys.job(stream.job_id), command
                )
            except NoScriptError:
                await self._records.load_scripts()
                continue
            except RedisError as exc:
                failures += 1
                self._warn(1, exc)
                await asyncio.sleep(pause(REDIS_WAIT, failures))
                continue
            if int(result) == NOT_YET:
                stream.roll_back()  # every delta landed, yet the record lacks one
            terminal.replicated = replication.enough(acked)
            return int(result) == WRITTEN and not stream.stale
        return False

    async def flush(self, stream: JobStream) -> None:
        """Until what was handed over for ``stream`` so far has landed (or the attempt went
        stale): a new attempt of the job starts only after its predecessor's output."""
        while not stream.stale and (stream.pending is not None or stream.unconfirmed):
            self._round_trip_done.clear()
            await self._round_trip_done.wait()

    def _mark(self, stream: JobStream) -> None:
        self._dirty[(stream.job_id, stream.attempt)] = stream
        self._wake.set()
        if self._in_flight:
            self._expedite(True)

    def _expedite(self, on: bool) -> None:
        if on != self._expedited:
            self._expedited = on
            self._sender.expedite(on)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="chatstream-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self._sender.aclose()

    async def _run(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self._write(batch)
            except RedisError as exc:  # the round trip failed as a whole (connection)
                self._retry_later(batch, exc)
            except Exception as exc:  # a bug must not stop every job's publishing
                log.exception("publish failed unexpectedly, retrying")
                self._retry_later(batch, exc)
            self._round_trip_done.set()
            # The reply came with the reads of the same poll; their tasks are queued
            # behind this one: let them fold and publish first, so their deltas share
            # the next round trip instead of waiting for the one after.
            await asyncio.sleep(0)

    async def _next_batch(self) -> list[JobStream]:
        """The jobs due for a round trip (at most ``max_batch``), waiting for one if none.

        Under load, round trips begin at most every ``round_trip_every`` seconds: the
        deltas that arrive meanwhile coalesce per job and share the round trip (each costs
        a write, a read and a wake-up). At low load a delta still goes out at once."""
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now, batch, next_due = loop.time(), [], None
            if self._dirty and now < self._not_before:
                with URGENT.hurry():  # (uvloop's timers fire up to a wake-up tick late)
                    await asyncio.sleep(self._not_before - now)
                continue
            for key, stream in list(self._dirty.items()):
                if stream.due <= now:
                    batch.append(self._dirty.pop(key))
                    if len(batch) >= self._max_batch:
                        break
                elif next_due is None or stream.due < next_due:
                    next_due = stream.due
            if batch:
                return batch
            if next_due is None:  # (no timeout scope: one fewer timer per round trip)
                await self._wake.wait()
                continue
            try:
                async with asyncio.timeout(next_due - now):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _write(self, batch: list[JobStream]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        records = self._records
        commands: list[Command] = []
        plan: list[Op] = []
        ends = False  # the batch carries a terminal entry (the job's end waits for its reply)
        for stream in batch:
            for seq, data in stream.take_ops():
                commands.append(records.delta_command(stream.job_id, stream.attempt, seq, data))
                plan.append((stream, DELTA, seq))
            if stream.terminal is not None:
                args = self._terminal_args(stream.terminal)
                commands.append(
                    records.finish_command(stream.job_id, stream.attempt, stream.seq, args)
                )
                plan.append((stream, TERMINAL, 0))
                ends = True
        self._not_before = loop.time() + self._round_trip_every  # from this send on
        self._in_flight = True
        self._expedite(bool(self._dirty) or ends)
        try:
            results = await self._sender.send(commands)
        finally:
            self._in_flight = False
            self._expedite(False)
        if self._on_batch is not None:
            self._on_batch(len(plan), loop.time() - began)
        await self._settle(batch, plan, results)

    async def _settle(self, batch: list[JobStream], plan: list[Op], results: list[Any]) -> None:
        again: set[int] = set()
        errors: list[Exception] = []
        for (stream, kind, seq), result in zip(plan, results, strict=True):
            if isinstance(result, Exception):
                errors.append(result)
                again.add(id(stream))
                continue
            code = int(result)
            if stream.settle_delta(seq, code) if kind == DELTA else stream.settle_terminal(code):
                again.add(id(stream))
        for stream in batch:
            if stream.stale:
                stream.drop()
            elif id(stream) in again:
                self._back_off(stream)
            else:
                stream.refusals = 0
        if errors:
            self._warn(len(errors), errors[0])
        if any(isinstance(exc, NoScriptError) for exc in errors):
            await self._records.load_scripts()  # Redis restarted without them

    def _retry_later(self, batch: list[JobStream], exc: Exception) -> None:
        """Every write of the batch is sent again (its sequence numbers make that safe)."""
        self._warn(len(batch), exc)
        for stream in batch:
            self._back_off(stream)

    def _back_off(self, stream: JobStream) -> None:
        stream.refusals += 1
        stream.due = asyncio.get_running_loop().time() + pause(REDIS_WAIT, stream.refusals)
        self._dirty.setdefault((stream.job_id, stream.attempt), stream)

    def _warn(self, count: int, example: Exception) -> None:
        """One warning per WARN_EVERY seconds while Redis refuses writes (they are retried)."""
        now = asyncio.get_running_loop().time()
        self._refused += count
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY:
            log.warning(
                "Redis refused %d event writes (%s: %s); retrying them in order",
                self._refused,
                type(example).__name__,
                example,
            )
            self._refused, self._warned_at = 0, now

    def _terminal_args(self, term: Terminal) -> list[Any]:
        flat = [item for pair in term.fields.items() for item in pair]
        data = dumps(term.event_data)
        return [term.event_type, data, self._records.retention, *flat]
