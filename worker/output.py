"""What the ``chatstream`` command and the demo print: events and job records.

A module of its own so that ``worker.cli`` (the commands) and ``worker.demo`` both use it
without importing each other.
"""

from __future__ import annotations

import json

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord


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
    else:
        print(f"\n[{event.type.value}]", flush=True)


def print_record(record: JobRecord, *, as_json: bool) -> None:
    if as_json:
        print(record.model_dump_json(exclude={"request"}), flush=True)
        return
    print(f"job       {record.id}\nstatus    {record.status.value}\nattempt   {record.attempt}")
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
