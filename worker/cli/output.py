"""What the ``chatstream`` command and the demo print: events, job records, job lists.

A module of its own so that ``worker.cli.main`` (the commands) and ``worker.cli.demo`` both use it
without importing each other.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from worker.store.jobs import JobPage, Progress


def print_event(event: StreamEvent, *, as_json: bool) -> None:
    if as_json:
        line = {
            "id": event.id,
            "type": event.type.value,
            "attempt": event.attempt,
            "data": event.data,
        }
        print(json.dumps(line, ensure_ascii=False), flush=True)
    elif event.type is EventType.DELTA:
        print(event.data.get("content", ""), end="", flush=True)
    elif event.type is EventType.RESET:
        print(f"\n[reset: attempt {event.attempt} starts over]", flush=True)
    elif event.type is EventType.WAITING:
        print(describe_waiting(event.data), file=sys.stderr, flush=True)
    else:
        print(f"\n[{event.type.value}]", flush=True)


def describe_waiting(data: dict[str, Any], now: float | None = None) -> str:
    """``waiting: upstream 'default' down for 12 s (...), next try in 4.0 s``: one line;
    with ``now`` (read later), how long it has waited by now, without the next try."""
    upstream, waited = data.get("upstream", "?"), _seconds(data.get("for_s"))
    since = data.get("since_ms")
    if now is not None and isinstance(since, int):
        waited = _seconds(round(max(now - since / 1000, 0.0)))
        data = {key: value for key, value in data.items() if key != "retry_in_s"}
    reason, model = data.get("reason"), data.get("model")
    if reason == "targets_unavailable":
        text = f"waiting: no target of route {data.get('route', '?')!r} free for {waited}"
    elif reason == "upstream_down":
        target = f" model {model!r}" if isinstance(model, str) else ""
        text = f"waiting: upstream {upstream!r}{target} down for {waited}"
    else:
        text = f"waiting: upstream {upstream!r} rate-limited for {waited}"
    if data.get("detail"):
        text += f" ({data['detail']})"
    if data.get("retry_in_s") is not None:
        text += f", next try in {_seconds(data['retry_in_s'])}"
    return text


def _seconds(value: Any) -> str:
    return f"{value:g} s" if isinstance(value, int | float) else "? s"


def print_record(record: JobRecord, *, as_json: bool, progress: Progress | None = None) -> None:
    """The record (JSON: its fields but the request); in text, a running job's progress
    stands where its content will be."""
    if as_json:
        print(record.model_dump_json(exclude={"request"}), flush=True)
        return
    print(f"job       {record.id}\nstatus    {record.status.value}\nattempt   {record.attempt}")
    if progress is not None:
        print(f"progress  {describe_progress(progress)}")
        if progress.waiting is not None:
            waiting = describe_waiting(progress.waiting, now=time.time())
            print(f"waiting   {waiting.removeprefix('waiting: ')}")
        if record.worker:
            print(f"worker    {record.worker}")
        print(f"upstream  {record.upstream}")
        return
    print(f"upstream  {record.upstream}")
    if record.served_upstream:
        model = f" model {record.served_model!r}" if record.served_model else ""
        print(f"served    upstream {record.served_upstream!r}{model}")
    if record.finish_reason:
        print(f"finish    {record.finish_reason}")
    if record.usage:
        print(f"usage     {json.dumps(record.usage)}")
    if record.error:
        print(f"error     {json.dumps(record.error)}")
    if record.tool_calls:
        print(f"tools     {json.dumps(record.tool_calls)}")
    print(
        f"content   {record.content!r}"
        if len(record.content) < 200
        else f"content   {record.content[:200]!r}… ({len(record.content)} chars)"
    )


def describe_progress(progress: Progress) -> str:
    """``12 deltas, 345 characters so far; running 3.2s, last delta 0.1s ago``."""
    parts = [f"{progress.deltas} deltas, {progress.characters} characters"]
    if progress.reasoning_characters:
        parts.append(f"{progress.reasoning_characters} reasoning characters")
    if progress.tool_calls:
        parts.append(f"{progress.tool_calls} tool calls")
    text = ", ".join(parts) + " so far"
    if progress.elapsed is not None:
        text += f"; running {progress.elapsed:.1f}s"
    if progress.last_delta_age is not None:
        text += f", last delta {progress.last_delta_age:.1f}s ago"
    elif progress.deltas == 0:
        text += ", no output yet"
    return text


def print_jobs(page: JobPage, *, as_json: bool) -> None:
    """One line per job, newest first (JSON: one object per line)."""
    if as_json:
        for job in page.jobs:
            print(json.dumps(job.to_json(), ensure_ascii=False), flush=True)
        return
    print(f"{'created (UTC)':<20} {'job':<34} {'status':<10} {'upstream':<12} att  error")
    for job in page.jobs:
        created = _utc(job.created_at)
        error = f"{job.error.get('code', '')}: {job.error.get('message', '')}" if job.error else ""
        print(
            f"{created:<20} {job.id:<34} {job.status:<10} {job.upstream:<12} "
            f"{job.attempt:<4} {error[:100]}",
            flush=True,
        )


def _utc(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S")
