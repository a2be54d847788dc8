"""The entries of a job's events stream, as consumers read them (see docs/events.md)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class EventType(StrEnum):
    DELTA = "delta"
    RESET = "reset"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"


TERMINAL_EVENTS: frozenset[EventType] = frozenset(
    {EventType.DONE, EventType.ERROR, EventType.CANCELLED}
)


class StreamEvent(BaseModel):
    """One entry of ``<prefix>:job:{<id>}:events``.

    ``id`` is the stream entry id: the resume cursor. ``data`` depends on ``type``:
    delta: ``{role?, content?, reasoning_details?, tool_calls?}`` (what arrived since the
    previous delta entry; tool-call fragments carry their ``index``);
    reset: ``{reason}``; done: ``{finish_reason, usage}``; error: ``{error, finish_reason,
    usage}``; cancelled: ``{usage}``.
    """

    id: str
    type: EventType
    attempt: int = Field(ge=1)
    data: dict[str, Any] = Field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    @classmethod
    def from_entry(cls, entry_id: str, fields: dict[str, str]) -> StreamEvent:
        return cls(
            id=entry_id,
            type=EventType(fields["type"]),
            attempt=int(fields["attempt"]),
            data=json.loads(fields.get("data") or "{}"),
        )
