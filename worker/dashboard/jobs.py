"""What the jobs and dead-letter pages read: the jobs index with filters, a job's record and
attempts, the dead letters with why each died. Job content (the request's messages, the
reply, the caller's metadata, the upstream's own error object) only for an operator's key.
"""

from __future__ import annotations

import json
import re
from typing import Any

from schemas.jobs import JSON_FIELDS
from schemas.requests import JOB_ID_PATTERN
from worker.store.jobs import JobPage
from worker.store.keys import Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

# record fields that hold what users sent or got: shown only with a key
CONTENT_FIELDS = frozenset(
    {
        "request", "content", "refusal", "reasoning", "tool_calls", "choices", "metadata",
        "response", "baggage", "web_search",
    }
)  # fmt: skip
EVENTS_PAGE = 1_000
MOST_EVENTS = 20_000  # entries of a job's stream read for its attempts, at most
_JOB_ID = re.compile(JOB_ID_PATTERN)
DEAD_FIELDS = ("status", "tenant", "upstream", "error", "attempt", "created_at", "finished_at")


def without_content(error: Any) -> Any:
    """A job's error without the upstream's own error object (``detail``), which may quote
    what the user sent."""
    if isinstance(error, dict) and "detail" in error:
        return {key: value for key, value in error.items() if key != "detail"} | {"detail": "…"}
    return error


def list_jobs(page: JobPage, with_content: bool) -> dict[str, Any]:
    rows = []
    for job in page.jobs:
        row = job.to_json()
        if not with_content:
            row["error"] = without_content(row["error"])
        rows.append(row)
    return {"jobs": rows, "next_before": page.next_before}


def record_view(raw: dict[str, str], with_content: bool) -> dict[str, Any]:
    """The record's fields (JSON ones decoded); content replaced by its size without a key."""
    view: dict[str, Any] = {}
    for name, value in sorted(raw.items()):
        decoded: Any = _json(value) if name in JSON_FIELDS and value else value
        if name in CONTENT_FIELDS and not with_content and value:
            decoded = {"hidden": True, "characters": len(value)}
        view[name] = decoded
    if not with_content:
        view["error"] = without_content(view.get("error"))
        view["request_summary"] = request_summary(raw.get("request", ""))
    return view


def request_summary(request: str) -> dict[str, Any]:
    """What an operator without a key may see of a request: model, sizes, options."""
    body = _json(request)
    if not isinstance(body, dict):
        return {"characters": len(request)}
    messages = body.get("messages")
    shown = ("model", "stream", "max_tokens", "max_completion_tokens", "n", "temperature")
    summary = {name: body[name] for name in shown if name in body}
    summary["messages"] = len(messages) if isinstance(messages, list) else None
    summary["characters"] = len(request)
    return summary


async def attempts(redis: RedisClient, keys: Keys, job_id: str) -> dict[str, Any]:
    """Each attempt as its events stream tells it: when its first and last entries came,
    its deltas, its last entry's type, why it started over (a reset's reason), and how
    often it waited (``waiting`` entries). Reads at most ``MOST_EVENTS`` entries."""
    found: dict[int, dict[str, Any]] = {}
    cursor, read = "-", 0
    while read < MOST_EVENTS:
        rows: Any = await redis.xrange(keys.events(job_id), cursor, "+", count=EVENTS_PAGE)
        for entry_id, fields in rows:
            _fold_entry(
                found, as_text(entry_id), {as_text(k): as_text(v) for k, v in fields.items()}
            )
        read += len(rows)
        if len(rows) < EVENTS_PAGE:
            break
        cursor = "(" + as_text(rows[-1][0])
    return {"attempts": [found[n] for n in sorted(found)], "entries": read,
            "complete": read < MOST_EVENTS}  # fmt: skip


def _fold_entry(found: dict[int, dict[str, Any]], entry_id: str, entry: dict[str, str]) -> None:
    number = int(entry["attempt"]) if entry.get("attempt", "").isdigit() else 0
    at = int(entry_id.partition("-")[0]) / 1000
    attempt = found.setdefault(
        number,
        {
            "attempt": number,
            "first": at,
            "last": at,
            "deltas": 0,
            "waiting": 0,
            "end": None,
            "reset_reason": None,
        },
    )
    attempt["last"] = at
    kind = entry.get("type", "")
    if kind == "delta":
        attempt["deltas"] += 1
    elif kind == "waiting":
        attempt["waiting"] += 1
    elif kind == "reset":
        data = _json(entry.get("data", ""))
        attempt["reset_reason"] = data.get("reason") if isinstance(data, dict) else None
    elif kind in ("done", "error", "cancelled"):
        attempt["end"] = kind


async def dead_letters(
    redis: RedisClient, keys: Keys, before: str | None, limit: int, with_content: bool
) -> dict[str, Any]:
    """The newest dead letters (before the entry id ``before``), each with its job's record
    fields; ``next_before`` to page on."""
    end = f"({before}" if before else "+"
    rows: Any = await redis.xrevrange(keys.dead, end, "-", count=limit)
    pipe = redis.pipeline(transaction=False)
    for _, fields in rows:
        pipe.hmget(keys.job(_job_of(fields)), list(DEAD_FIELDS))
    records = await pipe.execute() if rows else []
    letters = []
    for (entry_id, fields), values in zip(rows, records, strict=True):
        record = {name: as_text(v) for name, v in zip(DEAD_FIELDS, values, strict=True) if v}
        error = _json(record.pop("error", ""))
        letters.append({
            "entry": as_text(entry_id),
            "job": _job_of(fields),
            "reason": _json(as_text(fields.get("reason", ""))),
            "record": record or None,
            "error": error if with_content else without_content(error),
        })  # fmt: skip
    last = as_text(rows[-1][0]) if len(rows) == limit else None
    return {"dead_letters": letters, "next_before": last}


def _job_of(fields: dict[Any, Any]) -> str:
    job = as_text(fields.get("job", ""))
    return job if job and _valid_id(job) else ""


def _valid_id(job_id: str) -> bool:
    return _JOB_ID.match(job_id) is not None


def _json(value: str) -> Any:
    try:
        return json.loads(value) if value else None
    except ValueError:
        return value
