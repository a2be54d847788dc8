"""The job record and its events stream: every state change is one fenced Lua script.

A job's record (hash) and events stream share a hash tag, so each script touches one
Cluster slot. The fencing token is the record's ``attempt``: a write carries the attempt
that made it and is refused once a newer attempt started. Delta entries also carry a
per-attempt sequence number so a write retried after a lost reply is applied once.
See docs/redis.md for the data model.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import AsyncScript

from schemas.jobs import OUTPUT_FIELDS, SERVED_FIELDS
from worker.store import lua
from worker.store.batch import Command
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient
from worker.telemetry import TRACE_FIELDS

JSONish = dict[str, Any]
QUEUED_TO_TENANT = "tenant"  # queue_entry of a job handed to its tenant's queue

CREATE = lua.script("records/create")

START = lua.script("records/start")

# Results of DELTA and FINISH, as the publisher reads them.
WRITTEN, ALREADY, STALE, NOT_YET = 1, 0, -1, -2

DELTA = lua.script("records/delta")

FINISH = lua.script("records/finish")

RELEASE = lua.script("records/release")

HANDBACK = lua.script("records/handback")

ROLLED_BACK = lua.script("records/rolled_back")

REQUEUE = lua.script("records/requeue")

CANCEL = lua.script("records/cancel")

SET_ONCE = lua.script("records/set_once")
NOTICE = lua.script("records/notice")


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _c_encoder() -> Any:
    """The C encoder that ``_ENCODER.encode`` builds per call, built once (None where the
    json module has no C speedups). No circular-reference check: nothing we write refers
    to itself, and a structure that did would fail with RecursionError instead."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover (CPython always has it)
        return None
    return make(None, _ENCODER.default, json.encoder.encode_basestring, None, ":", ",",
                False, False, True)  # fmt: skip


_C_ENCODE = _c_encoder()


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII as is, exactly as ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)``; the C encoder built once (building it per call was a third of
    the cost of an entry's JSON, decision 65)."""
    if _C_ENCODE is None:  # pragma: no cover
        return _ENCODER.encode(value)
    return "".join(_C_ENCODE(value, 0))


@dataclass(frozen=True, slots=True)
class Started:
    """The outcome of trying to start an attempt of a job."""

    state: str  # started | missing | terminal | busy | superseded | exhausted | invalid
    attempt: int = 0
    request: str = ""
    upstream: str = "default"
    dead_pending: bool = False  # failed for exhausted attempts, not yet on the dead stream
    error: str = ""  # exhausted | invalid: the error (JSON) the job failed with
    created_at: float | None = None  # started: when the job was enqueued (its record's)
    trace_context: Mapping[str, str] = field(default_factory=dict)  # started: W3C fields


class Records:
    """The fenced record/stream operations, as registered Lua scripts."""

    def __init__(self, redis: RedisClient, keys: Keys, retention_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.retention = retention_seconds
        self.create_script: AsyncScript = redis.register_script(CREATE)
        self._start = redis.register_script(START)
        self.delta_script: AsyncScript = redis.register_script(DELTA)
        self.finish_script: AsyncScript = redis.register_script(FINISH)
        self._release = redis.register_script(RELEASE)
        self._handback = redis.register_script(HANDBACK)
        self._rolled_back = redis.register_script(ROLLED_BACK)
        self._requeue = redis.register_script(REQUEUE)
        self._cancel = redis.register_script(CANCEL)
        self._set_once = redis.register_script(SET_ONCE)
        self._notice = redis.register_script(NOTICE)

    def job_keys(self, job_id: str) -> list[str]:
        return [self.keys.job(job_id), self.keys.events(job_id)]

    async def load_scripts(self) -> None:
        """Load the pipelined scripts (again after a Redis restart: NOSCRIPT)."""
        for script in (self.delta_script, self.finish_script):
            script.sha = as_text(await self.redis.script_load(script.script))

    def delta_command(self, job_id: str, attempt: int, seq: int, data: str) -> Command:
        """One fenced delta write (EVALSHA: no per-batch SCRIPT EXISTS)."""
        keys = self.job_keys(job_id)
        return ("EVALSHA", self.delta_script.sha, 2, *keys, attempt, seq, data, self.retention)

    def finish_command(self, job_id: str, attempt: int, last_seq: int, args: list[Any]) -> Command:
        """The fenced terminal write, after the attempt's delta ``last_seq``."""
        keys = self.job_keys(job_id)
        return ("EVALSHA", self.finish_script.sha, 2, *keys, attempt, last_seq, *args)

    async def notice(self, job_id: str, attempt: int, event_type: str, data: str) -> bool:
        """A progress entry (``waiting``) of the running attempt; False when it is stale."""
        args: list[str | int] = [attempt, event_type, data, self.retention]
        return int(await self._notice(keys=self.job_keys(job_id), args=args)) == WRITTEN

    async def create(self, job_id: str, fields: dict[str, str]) -> str:
        """Create the record unless it exists: ``created``, ``exists`` or ``unqueued``."""
        flat = [item for pair in fields.items() for item in pair]
        result = await self.create_script(keys=self.job_keys(job_id), args=[self.retention, *flat])
        return as_text(result)

    async def mark_queued(self, job_id: str, entry_id: str) -> None:
        """The enqueue is complete: the job waits in the queue (``entry_id``: its stream
        entry, or ``QUEUED_TO_TENANT`` while it waits in its tenant's queue)."""
        await self.redis.hset(self.keys.job(job_id), "queue_entry", entry_id)

    async def discard(self, job_id: str) -> None:
        """Delete a record whose enqueue was refused (nothing else refers to it)."""
        await self.redis.delete(self.keys.job(job_id))

    async def start(
        self,
        job_id: str,
        worker: str,
        max_attempts: int,
        entry: str = "",
        token: str = "",
        *,
        delivery: int | None = None,
        restart_of: int | None = None,
        dispatched_at: float | None = None,
        reset_detail: str = "",
    ) -> Started:
        """Start the next attempt (fenced: every earlier attempt's writes are refused).

        ``entry`` is the queue entry the attempt runs under: while the job runs under
        another entry, a duplicate entry is refused (``busy``), so at most one attempt runs.
        ``delivery`` is that entry's delivery count: a start from the entry the job already
        runs under is a takeover only with a higher count, else ``superseded`` (a stale
        delivery never replaces a live attempt). ``restart_of`` starts a new attempt of the
        caller's own run, only while that attempt is current (else ``superseded``).
        ``token`` identifies this start: pass the same one when retrying it after an error
        (the reply may have been lost after the start happened) to get the same attempt.
        ``dispatched_at`` (when the entry left its tenant's queue) is kept from the first
        start as the record's ``dispatched_at``. ``reset_detail``: a JSON object of fields the
        ``reset`` entry adds to its ``reason`` (what failed before, ``after``).
        """
        now, token = f"{time.time():.6f}", token or secrets.token_hex(8)
        args: list[str | int] = [
            worker,
            now,
            max_attempts,
            self.retention,
            entry,
            "" if delivery is None else delivery,
            token,
            "" if restart_of is None else restart_of,
            "" if dispatched_at is None else f"{dispatched_at:.3f}",
            reset_detail,
        ]
        result = await self._start(keys=self.job_keys(job_id), args=args)
        state = as_text(result[0])
        if state == "started":
            return _started(result)
        attempt = int(result[1]) if len(result) > 1 else 0
        dead_pending = len(result) > 2 and as_text(result[2]) == "1"
        if len(result) > 4:  # failed here: exhausted | invalid
            upstream, error = as_text(result[3]), as_text(result[4])
            return Started(state, attempt, "", upstream, dead_pending, error)
        return Started(state, attempt, dead_pending=dead_pending)

    async def release(self, job_id: str, attempt: int) -> bool:
        """Give a running attempt back (status queued); False when it is not current."""
        return int(await self._release(keys=[self.keys.job(job_id)], args=[attempt])) == 1

    async def rolled_back(self, job_id: str, attempt: int) -> str:
        """Queue the job again after Redis lost writes of ``attempt`` (see ROLLED_BACK)."""
        return as_text(await self._rolled_back(keys=[self.keys.job(job_id)], args=[attempt]))

    async def hand_back(self, job_id: str, entry: str) -> bool:
        """Release whatever attempt runs under ``entry`` (no live task runs it)."""
        return int(await self._handback(keys=[self.keys.job(job_id)], args=[entry])) == 1

    async def requeue(self, job_id: str) -> str:
        """A failed job back to ``queued`` with a fresh attempt budget.

        Returns ``requeued`` or ``unqueued`` (the caller adds a queue entry), ``queued``
        (it already is), ``missing``, or the job's other status (refused).
        """
        args: list[str | int] = [
            f"{time.time():.6f}",
            self.retention,
            *OUTPUT_FIELDS,
            *SERVED_FIELDS,
        ]
        return as_text(await self._requeue(keys=self.job_keys(job_id), args=args))

    async def dead_lettered(self, job_id: str, dead_entry: str) -> None:
        """The job is on the dead-letter stream (entry ``dead_entry``)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.keys.job(job_id), "dead_pending")
        pipe.hset(self.keys.job(job_id), "dead_letter", dead_entry)
        await pipe.execute()

    async def closing_state(self, job_id: str) -> tuple[str, bool, int]:
        """(status, dead_pending, attempt) of the record: what is left to do for its queue
        entry."""
        fields = ["status", "dead_pending", "attempt"]
        status, pending, attempt = await self.redis.hmget(self.keys.job(job_id), fields)
        status = as_text(status) if status is not None else "missing"
        number = as_text(attempt) if attempt is not None else ""
        return status, pending is not None, int(number) if number.isdigit() else 0

    async def cancel(self, job_id: str) -> str:
        args: list[str | int] = [f"{time.time():.6f}", self.retention]
        return as_text(await self._cancel(keys=self.job_keys(job_id), args=args))

    async def cancel_requested(self, job_ids: list[str]) -> list[bool]:
        """Whether a cancel was requested for each job (one pipelined round trip); the
        fallback for a pub/sub cancel message a worker missed."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel_requested")
        flags = await pipe.execute()
        return [flag is not None and as_text(flag) == "1" for flag in flags]

    async def set_once(self, job_id: str, field: str, value: str) -> str | None:
        """Set ``field`` of the record unless it has a value; the value it has afterwards
        (``value`` or an earlier one), None when there is no record."""
        result = await self._set_once(keys=[self.keys.job(job_id)], args=[field, value])
        return None if result is None else as_text(result)

    async def fetch(self, job_id: str) -> dict[str, str]:
        raw: dict[Any, Any] = await self.redis.hgetall(self.keys.job(job_id))
        return {as_text(k): as_text(v) for k, v in raw.items()}


def _started(result: list[Any]) -> Started:
    """START's ``started`` reply: attempt, request, upstream, then the job's origin
    (created_at and the trace context fields, empty when the record has none)."""
    created, *context = [as_text(value) for value in result[4:8]] + [""] * (8 - len(result))
    pairs = zip(TRACE_FIELDS, context, strict=True)
    trace_context = {name: value for name, value in pairs if value}
    try:
        created_at = float(created) if created else None
    except ValueError:  # a producer's malformed created_at only loses the queued time
        created_at = None
    return Started(
        "started",
        int(result[1]),
        as_text(result[2]),
        as_text(result[3]),
        created_at=created_at,
        trace_context=trace_context,
    )


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
