"""The fleet's activity per minute: what finished, tokens, time to first token, failures.

Workers count their jobs' ends in memory (``Tally``: a few dict increments per finished job,
nothing per token) and add the counts to one hash per minute, ``<p>:activity:<minute>``
(Unix minute), from their upkeep about once a second (``ActivityLog.add``: one script per
minute touched, ``HINCRBY`` of each field and the key's expiry). The dashboard reads the
last hour (or day) of them for its charts; nothing else keeps history, so a dashboard
restart loses nothing.

Bounded: a key expires a day after its last write (``TTL_SECONDS``), so at most 1,441 exist,
and each holds at most ``MAX_FIELDS`` fields: the fixed ones (statuses, tokens, the time to
first token histogram), one per error code (a fixed set; others count as ``other``), three
per upstream (configured names; others count as ``other``) and three per tenant, while the
hash has room: a tenant first seen in a minute whose hash is full counts as ``~other``.

Fields (all integers):

=================== ===================================================================
``n:<status>``      jobs that ended ``succeeded``, ``failed`` or ``cancelled``
``tok``, ``ptok``   completion and prompt tokens of the usage the upstreams reported (a
                    job without usage adds its delta entries to ``tok``)
``ttft:<i>``        jobs whose first delta came within bucket *i* of ``TTFT_BOUNDS_MS``
                    (the last bucket: later)
``f:<code>``        failed jobs by error code
``u:<name>:n|f|tok`` per upstream: ended, failed, completion tokens
``t:<name>:n|f|tok`` per tenant: ended, failed, completion tokens
``r:<name>:n|f|fb``  per route (configured names): ended, failed, fallbacks taken (the
                    times a job left a target for the next)
=================== ===================================================================
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import AsyncScript

from worker.errors import ChatstreamError
from worker.store import lua
from worker.store.keys import Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

ADD = lua.script("activity/add")
TTL_SECONDS = 86_400 + 120  # a day of minutes, and the minute being written
MAX_FIELDS = 400
TTFT_BOUNDS_MS = (50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000, 20000, 60000)
STATUSES = ("succeeded", "failed", "cancelled")
TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
OTHER = "other"


def _codes(kind: type[ChatstreamError]) -> set[str]:
    return {kind.code}.union(*(_codes(sub) for sub in kind.__subclasses__()))


# what a failed job's error may say: the error tree's codes, and the dead letter's
KNOWN_CODES = frozenset(_codes(ChatstreamError) | {"attempts_exhausted"})


def minute_of(unix_seconds: float) -> int:
    return int(unix_seconds // 60)


def code_field(code: str) -> str:
    """A failure's error code as a field name: a known code, else ``other``."""
    return code if code in KNOWN_CODES else OTHER


def ttft_bucket(seconds: float) -> int:
    ms = seconds * 1000
    for index, bound in enumerate(TTFT_BOUNDS_MS):
        if ms <= bound:
            return index
    return len(TTFT_BOUNDS_MS)


@dataclass(frozen=True, slots=True)
class Finished:
    """One job's end, as the activity counts it."""

    status: str
    tenant: str
    upstream: str  # a bounded label: a configured name, or ``other``
    completion_tokens: int = 0
    prompt_tokens: int = 0
    first_token_seconds: float | None = None
    code: str | None = None  # the error code of a failed job
    route: str | None = None  # the route it used (a configured name), if any
    fallbacks: int = 0  # the times it left a route's target for the next


class Tally:
    """A worker's counts not yet added to Redis, per minute: a few increments per job."""

    def __init__(self) -> None:
        self.pending: dict[int, dict[str, int]] = {}

    def finished(self, job: Finished, now: float | None = None) -> None:
        counts = self.pending.setdefault(minute_of(time.time() if now is None else now), {})
        status = job.status if job.status in STATUSES else OTHER
        tenant = job.tenant if TENANT.fullmatch(job.tenant) else "~other"
        fields = [f"n:{status}", f"u:{job.upstream}:n", f"t:{tenant}:n"]
        if status == "failed":
            fields += [f"f:{code_field(job.code or 'error')}", f"u:{job.upstream}:f"]
            fields.append(f"t:{tenant}:f")
        if job.first_token_seconds is not None:
            fields.append(f"ttft:{ttft_bucket(job.first_token_seconds)}")
        if job.route is not None:
            fields.append(f"r:{job.route}:n")
            if status == "failed":
                fields.append(f"r:{job.route}:f")
        for name in fields:
            counts[name] = counts.get(name, 0) + 1
        if job.route is not None and job.fallbacks:
            name = f"r:{job.route}:fb"
            counts[name] = counts.get(name, 0) + job.fallbacks
        for name, tokens in (
            ("tok", job.completion_tokens),
            ("ptok", job.prompt_tokens),
            (f"u:{job.upstream}:tok", job.completion_tokens),
            (f"t:{tenant}:tok", job.completion_tokens),
        ):
            if tokens > 0:
                counts[name] = counts.get(name, 0) + tokens

    def take(self) -> dict[int, dict[str, int]]:
        """What was counted since the last take (the tally starts empty again)."""
        pending, self.pending = self.pending, {}
        return pending

    def give_back(self, pending: Mapping[int, Mapping[str, int]]) -> None:
        """Counts whose write failed: added again, to go with the next one."""
        for minute, fields in pending.items():
            counts = self.pending.setdefault(minute, {})
            for name, value in fields.items():
                counts[name] = counts.get(name, 0) + value


class ActivityLog:
    """The per-minute hashes in Redis: written by workers, read by the dashboard."""

    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._add: AsyncScript = redis.register_script(ADD)

    async def add(self, minute: int, counts: Mapping[str, int]) -> None:
        """Add a tally's counts of one minute (one script call)."""
        args: list[Any] = [TTL_SECONDS, MAX_FIELDS]
        for name, value in counts.items():
            args += (name, value)
        await self._add(keys=[self.keys.activity(minute)], args=args)

    async def read(self, minutes: Iterable[int]) -> dict[int, dict[str, int]]:
        """The counts of these minutes (a minute nobody wrote is empty)."""
        wanted = list(minutes)
        if not wanted:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for minute in wanted:
            pipe.hgetall(self.keys.activity(minute))
        replies = await pipe.execute()
        return {minute: _counts(raw) for minute, raw in zip(wanted, replies, strict=True)}


def _counts(raw: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key, value in (raw or {}).items():
        text = as_text(value)
        if text.lstrip("-").isdigit():
            counts[as_text(key)] = int(text)
    return counts


# -- reading the counts: series and percentiles (pure) -------------------------------------


@dataclass(slots=True)
class Series:
    """Per-point values of a window of minutes, oldest first (``step`` minutes per point)."""

    start_minute: int
    step: int
    finished: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ttft_p50_ms: list[float | None] = field(default_factory=list)
    ttft_p95_ms: list[float | None] = field(default_factory=list)
    failures: dict[str, list[int]] = field(default_factory=dict)  # per error code

    def to_json(self) -> dict[str, Any]:
        return {
            "start": self.start_minute * 60,
            "step_seconds": self.step * 60,
            "finished": self.finished,
            "failed": self.failed,
            "tokens": self.tokens,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p95_ms": self.ttft_p95_ms,
            "failures": self.failures,
        }


def series(counts: Mapping[int, Mapping[str, int]], start: int, points: int, step: int) -> Series:
    """``points`` points of ``step`` minutes from minute ``start``."""
    out = Series(start, step)
    codes = sorted({name[2:] for minute in counts.values() for name in minute if name[:2] == "f:"})
    out.failures = {code: [] for code in codes}
    for point in range(points):
        merged = merge(counts.get(start + point * step + i, {}) for i in range(step))
        out.finished.append(sum(merged.get(f"n:{status}", 0) for status in STATUSES))
        out.failed.append(merged.get("n:failed", 0))
        out.tokens.append(merged.get("tok", 0))
        histogram = ttft_histogram(merged)
        out.ttft_p50_ms.append(quantile(histogram, 0.5))
        out.ttft_p95_ms.append(quantile(histogram, 0.95))
        for code in codes:
            out.failures[code].append(merged.get(f"f:{code}", 0))
    return out


def merge(minutes: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for minute in minutes:
        for name, value in minute.items():
            total[name] = total.get(name, 0) + value
    return total


def ttft_histogram(counts: Mapping[str, int]) -> list[int]:
    return [counts.get(f"ttft:{index}", 0) for index in range(len(TTFT_BOUNDS_MS) + 1)]


def quantile(histogram: list[int], q: float) -> float | None:
    """The ``q`` quantile (ms) of a bucketed histogram, interpolated linearly within its
    bucket as Prometheus' ``histogram_quantile`` does (the open last bucket: its lower
    bound). None without samples."""
    total = sum(histogram)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(histogram):
        if count and seen + count >= rank:
            if index == len(TTFT_BOUNDS_MS):
                return float(TTFT_BOUNDS_MS[-1])
            low = 0 if index == 0 else TTFT_BOUNDS_MS[index - 1]
            high = TTFT_BOUNDS_MS[index]
            return low + (high - low) * max(rank - seen, 0) / count
        seen += count
    return float(TTFT_BOUNDS_MS[-1])  # unreachable with q <= 1


def per_name(counts: Mapping[str, int], kind: str) -> dict[str, dict[str, int]]:
    """``u``, ``t`` or ``r`` fields as name -> {n, f, tok} (and a route's ``fb``)."""
    found: dict[str, dict[str, int]] = {}
    for name, value in counts.items():
        if name.startswith(kind + ":"):
            who, _, what = name[2:].rpartition(":")
            found.setdefault(who, {"n": 0, "f": 0, "tok": 0})[what] = value
    return found


def rate(total: int, seconds: float) -> float:
    return 0.0 if seconds <= 0 else round(total / seconds, 3 if total < 1000 else 1)
