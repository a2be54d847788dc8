"""Finding jobs and looking into running ones: the jobs index and a job's progress.

The index is one sorted set per prefix, ``<p>:jobs``: member the job id, score its enqueue
time (Unix seconds). ``Client.enqueue`` adds to it in one script (``INDEX_ADD``) that also
drops the entries older than the retention (their records are gone or going), keeps at
most ``max_entries`` (the newest) and sets the key's TTL to the retention, so the index
stays bounded and vanishes when nothing is enqueued for a retention period. It never
scans keys: listing reads the newest entries (``ZRANGE ... BYSCORE REV LIMIT``) and each
job's summary fields (``HMGET``, pipelined), filtering by status and upstream as it goes.

Cost per job: one script call (one round trip) at enqueue; about 140 bytes of Redis memory
for a 32-hex-digit id (measured with ``MEMORY USAGE`` on Redis 7.0). The key is one key on
one shard of a Redis Cluster; a queue sharded over several streams would keep one index
per shard and merge them by score when listing (see docs/redis.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from redis.commands.core import AsyncScript

from worker.store import lua
from worker.store.batch import Command
from worker.store.keys import Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

INDEX_ADD = lua.script("jobs/index_add")

SUMMARY_FIELDS = (
    "status",
    "upstream",
    "tenant",
    "priority",
    "attempt",
    "created_at",
    "started_at",
    "finished_at",
    "model",
    "error",
)
PAGE = 200  # index entries read (and records fetched) per round trip
SCAN_LIMIT = 10_000  # index entries one listing examines at most


@dataclass(frozen=True, slots=True)
class JobSummary:
    """What ``chatstream jobs`` shows of a job: its record without request and output."""

    id: str
    status: str
    upstream: str
    tenant: str
    priority: str
    attempt: int
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    model: str | None
    error: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class JobPage:
    """Newest first. ``next_before``: pass it as ``before`` for the jobs after these (None
    when the index has no more)."""

    jobs: list[JobSummary]
    next_before: float | None


class JobIndex:
    """The index: one sorted set per queue shard (``Keys.jobs_shard``; shard *i* > 0's in
    the shard's slot); listing merges them newest first."""

    def __init__(self, redis: RedisClient, keys: Keys, retention_seconds: int, max_entries: int):
        self.redis = redis
        self.keys = keys
        self.retention = retention_seconds
        self.max_entries = max_entries
        self.add_script: AsyncScript = redis.register_script(INDEX_ADD)

    async def add(self, job_id: str, enqueued_at: float | None = None) -> None:
        """Index a job (again: a requeue moves it to the front); a no-op when disabled."""
        if self.max_entries <= 0:
            return
        await self.add_script(keys=[self._key(job_id)], args=self._args(job_id, enqueued_at))

    def add_command(self, job_id: str, enqueued_at: float | None = None) -> Command | None:
        """``add`` as one command for a batch (None when the index is disabled)."""
        if self.max_entries <= 0:
            return None
        return (
            "EVALSHA",
            self.add_script.sha,
            1,
            self._key(job_id),
            *self._args(job_id, enqueued_at),
        )

    def add_commands(self, jobs: list[tuple[str, float]]) -> list[Command]:
        """``add`` for many jobs in few commands: one ``ZADD`` per shard's index, then the
        script (trim, expiry) once per shard with its last job."""
        if self.max_entries <= 0 or not jobs:
            return []
        by_key: dict[str, list[tuple[str, float]]] = {}
        for job_id, when in jobs:
            by_key.setdefault(self._key(job_id), []).append((job_id, when))
        commands: list[Command] = []
        for key, members in by_key.items():
            flat = [item for job_id, when in members for item in (f"{when:.6f}", job_id)]
            last_id, last_when = members[-1]
            commands.append(("ZADD", key, *flat))
            commands.append(self.add_command(last_id, last_when) or ("PING",))
        return commands

    def remove_command(self, job_id: str) -> Command:
        return ("ZREM", self._key(job_id), job_id)

    async def remove(self, job_id: str) -> None:
        """Unlist a job (its enqueue was refused)."""
        await self.redis.zrem(self._key(job_id), job_id)

    def _key(self, job_id: str) -> str:
        return self.keys.jobs_shard(self.keys.shard_of(job_id))

    def _args(self, job_id: str, enqueued_at: float | None) -> list[str | int]:
        when = time.time() if enqueued_at is None else enqueued_at
        per_shard = -(-self.max_entries // self.keys.shards)
        return [f"{when:.6f}", job_id, self.retention, per_shard]

    async def page(
        self,
        *,
        status: str | None = None,
        upstream: str | None = None,
        tenant: str | None = None,
        limit: int = 20,
        before: float | None = None,
        since: float | None = None,
        scan: int = SCAN_LIMIT,
    ) -> JobPage:
        """The newest ``limit`` jobs enqueued before ``before`` (and at or after ``since``)
        that match; at most ``scan`` index entries are examined (then ``next_before`` says
        where to go on)."""
        found: list[JobSummary] = []
        cursor = f"({before!r}" if before is not None else "+inf"
        floor = "-inf" if since is None else repr(since)
        wanted = {"status": status, "upstream": upstream, "tenant": tenant}
        examined, last = 0, None
        while examined < scan:
            rows, more = await self._newest(cursor, min(PAGE, scan - examined), floor)
            examined += len(rows)
            for (_, score), summary in zip(rows, await self._summaries(rows), strict=True):
                last = float(score)
                if summary is not None and _matches(summary, wanted):
                    found.append(summary)
                    if len(found) == limit:
                        return JobPage(found, last)
            if not more or last is None:
                return JobPage(found, None)
            cursor = f"({last!r}"
        return JobPage(found, last)

    async def _newest(self, cursor: str, count: int, floor: str) -> tuple[list[Any], bool]:
        """The newest ``count`` entries of all shards' indexes below ``cursor`` and at or above
        ``floor`` (and any that tie with the last of them), newest first; whether older ones
        may follow."""
        rows: list[Any] = []
        more = False
        for shard in range(self.keys.shards):
            part: Any = await self.redis.zrevrangebyscore(
                self.keys.jobs_shard(shard), cursor, floor, start=0, num=count, withscores=True
            )
            rows += part
            more = more or len(part) == count
        rows.sort(key=lambda row: float(row[1]), reverse=True)
        if len(rows) > count:
            cut = float(rows[count - 1][1])
            kept = [row for row in rows if float(row[1]) >= cut]
            return kept, True
        return rows, more

    async def _summaries(self, rows: list[Any]) -> list[JobSummary | None]:
        if not rows:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id, _ in rows:
            pipe.hmget(self.keys.job(as_text(job_id)), list(SUMMARY_FIELDS))
        replies = await pipe.execute()
        return [_summary(as_text(row[0]), raw) for row, raw in zip(rows, replies, strict=True)]


def _matches(summary: JobSummary, wanted: dict[str, str | None]) -> bool:
    return all(value is None or getattr(summary, name) == value for name, value in wanted.items())


def _summary(job_id: str, values: list[Any]) -> JobSummary | None:
    """The summary from HMGET values; None when the record is gone (expired, deleted).
    Fields another producer wrote badly show as absent rather than failing the list."""
    texts = [None if value is None else as_text(value) for value in values]
    raw = dict(zip(SUMMARY_FIELDS, texts, strict=True))
    if not any(raw.values()):
        return None
    return JobSummary(
        id=job_id,
        status=raw["status"] or "?",
        upstream=raw["upstream"] or "default",
        tenant=raw["tenant"] or "default",
        priority=raw["priority"] or "normal",
        attempt=int(attempt) if (attempt := raw["attempt"] or "").isdigit() else 0,
        created_at=_float(raw["created_at"]),
        started_at=_float(raw["started_at"]),
        finished_at=_float(raw["finished_at"]),
        model=raw["model"] or None,
        error=_error(raw["error"]),
    )


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _error(value: str | None) -> dict[str, Any] | None:
    if not value:
        return None
    try:
        error = json.loads(value)
    except ValueError:
        return {"message": value}
    return error if isinstance(error, dict) else {"message": value}


# -- a running job's progress ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the current attempt of a job got, read from its events stream."""

    attempt: int
    deltas: int  # delta entries of this attempt
    characters: int  # content characters so far
    reasoning_characters: int
    tool_calls: int  # distinct tool-call indexes so far
    elapsed: float | None  # seconds since the attempt started (the worker's clock)
    last_delta_age: float | None  # seconds since the last delta entry (Redis's clock)
    waiting: dict[str, Any] | None = None  # the attempt's last waiting entry, before any delta


async def read_progress(
    redis: RedisClient, keys: Keys, job_id: str, attempt: int, started_at: float | None
) -> Progress:
    """Counts the attempt's delta entries (reads the whole stream, in pages of 1000)."""
    counts = {"deltas": 0, "characters": 0, "reasoning": 0}
    calls: set[int] = set()
    last_millis: int | None = None
    waiting: dict[str, Any] | None = None
    cursor = "-"
    while True:
        rows: Any = await redis.xrange(keys.events(job_id), cursor, "+", count=1000)
        for entry_id, fields in rows:
            entry = {as_text(k): as_text(v) for k, v in fields.items()}
            if entry.get("attempt") != str(attempt):
                continue
            if entry.get("type") == "delta":
                _count_delta(entry.get("data", "{}"), counts, calls)
                last_millis = int(as_text(entry_id).split("-")[0])
            elif entry.get("type") == "waiting":
                waiting = _json_object(entry.get("data", "{}"))
        if len(rows) < 1000:
            break
        cursor = "(" + as_text(rows[-1][0])
    now = time.time()
    return Progress(
        attempt=attempt,
        deltas=counts["deltas"],
        characters=counts["characters"],
        reasoning_characters=counts["reasoning"],
        tool_calls=len(calls),
        elapsed=None if started_at is None else max(now - started_at, 0.0),
        last_delta_age=None if last_millis is None else max(now - last_millis / 1000, 0.0),
        waiting=waiting if counts["deltas"] == 0 else None,
    )


def _json_object(data: str) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _count_delta(data: str, counts: dict[str, int], calls: set[int]) -> None:
    try:
        delta = json.loads(data)
    except ValueError:
        return
    if not isinstance(delta, dict):
        return
    counts["deltas"] += 1
    content = delta.get("content")
    counts["characters"] += len(content) if isinstance(content, str) else 0
    for fragment in delta.get("reasoning_details") or []:
        if isinstance(fragment, dict):
            text = fragment.get("text") or fragment.get("summary") or ""
            counts["reasoning"] += len(text) if isinstance(text, str) else 0
    for call in delta.get("tool_calls") or []:
        if isinstance(call, dict) and isinstance(call.get("index"), int):
            calls.add(call["index"])
