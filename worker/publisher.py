"""Coalescing, pipelined publishing of every in-flight job's events.

Deltas are handed to :meth:`Publisher.publish` without waiting. One flusher task writes
whatever is pending for *all* jobs in one pipelined round trip, then looks again: at low
load a delta goes out at once (no fixed delay); at high load the deltas that arrive while
a round trip is in flight are merged per job into its next entry, so round trips stay few
and a delta waits at most about one round trip. A job's entries keep their order: its
pending delta is always written before its terminal entry, in the same pipeline.

Each delta entry carries a per-attempt sequence number: a batch retried after a lost
reply (Redis restart) is applied once. Writes refused by the fence mark the job stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from worker.accumulator import Delta
from worker.records import Records, dumps
from worker.tasks import cancel_and_wait

log = logging.getLogger("chatstream.publisher")

RETRY_DELAY = 0.2


@dataclass(slots=True)
class Terminal:
    """The terminal write: record fields plus the closing event, applied atomically."""

    event_type: str
    event_data: dict[str, Any]
    fields: dict[str, str]
    done: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(slots=True)
class JobStream:
    """One attempt's publishing state."""

    job_id: str
    attempt: int
    pending: Delta | None = None
    unconfirmed: list[tuple[int, str]] = field(default_factory=list)
    seq: int = 0
    terminal: Terminal | None = None
    stale: bool = False

    def take_ops(self) -> list[tuple[int, str]]:
        if self.pending is not None:
            self.seq += 1
            self.unconfirmed.append((self.seq, dumps(self.pending.to_json())))
            self.pending = None
        return list(self.unconfirmed)


BatchObserver = Callable[[int, float], None]


class Publisher:
    def __init__(
        self,
        redis: Redis,
        records: Records,
        max_batch: int = 1000,
        on_batch: BatchObserver | None = None,
    ) -> None:
        self._redis = redis
        self._records = records
        self._max_batch = max_batch
        self._on_batch = on_batch
        self._dirty: dict[tuple[str, int], JobStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

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
        """Write pending deltas then the terminal entry; False when the attempt is stale."""
        stream.terminal = terminal
        self._mark(stream)
        return await asyncio.shield(terminal.done) == 1

    def _mark(self, stream: JobStream) -> None:
        self._dirty[(stream.job_id, stream.attempt)] = stream
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="chatstream-publisher")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                batch = self._take_batch()
                try:
                    await self._write(batch)
                except NoScriptError:
                    await self._requeue(batch, self._records.load_scripts())
                except RedisError as exc:
                    log.warning("publish failed, retrying: %s", exc)
                    await self._requeue(batch, asyncio.sleep(RETRY_DELAY))
                except Exception:  # a bug must not stop every job's publishing
                    log.exception("publish failed unexpectedly, retrying")
                    await self._requeue(batch, asyncio.sleep(RETRY_DELAY))

    async def _requeue(self, batch: list[JobStream], pause: Awaitable[Any]) -> None:
        """Put a failed batch back (its entries keep their sequence numbers) and pause."""
        for stream in batch:
            self._dirty.setdefault((stream.job_id, stream.attempt), stream)
        try:
            await pause
        except RedisError as exc:
            log.warning("reloading scripts failed: %s", exc)
            await asyncio.sleep(RETRY_DELAY)

    def _take_batch(self) -> list[JobStream]:
        batch: list[JobStream] = []
        for key in list(self._dirty)[: self._max_batch]:
            batch.append(self._dirty.pop(key))
        return batch

    async def _write(self, batch: list[JobStream]) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        pipe = self._redis.pipeline(transaction=False)
        plan: list[tuple[JobStream, str, int]] = []
        for stream in batch:
            for seq, data in stream.take_ops():
                self._records.queue_delta(pipe, stream.job_id, stream.attempt, seq, data)
                plan.append((stream, "delta", seq))
            if stream.terminal is not None:
                args = self._terminal_args(stream)
                self._records.queue_finish(pipe, stream.job_id, stream.attempt, args)
                plan.append((stream, "terminal", 0))
        results = await pipe.execute()
        for (stream, kind, seq), result in zip(plan, results, strict=True):
            self._settle(stream, kind, seq, int(result))
        if self._on_batch is not None:
            self._on_batch(len(plan), loop.time() - began)

    def _terminal_args(self, stream: JobStream) -> list[Any]:
        assert stream.terminal is not None
        term = stream.terminal
        flat = [item for pair in term.fields.items() for item in pair]
        data = dumps(term.event_data)
        return [term.event_type, data, self._records.retention, *flat]

    def _settle(self, stream: JobStream, kind: str, seq: int, result: int) -> None:
        if kind == "delta":
            stream.unconfirmed = [op for op in stream.unconfirmed if op[0] != seq]
            stream.stale |= result < 0
            return
        assert stream.terminal is not None
        if not stream.terminal.done.done():
            stream.terminal.done.set_result(result)
