"""The job record: one Redis hash per job (see docs/redis.md for the field table)."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: frozenset[JobStatus] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED}
)

JSON_FIELDS = (
    "request",
    "reasoning",
    "tool_calls",
    "usage",
    "error",
    "metadata",
    "web_search",
    "free_tier",
)
FLOAT_FIELDS = ("created_at", "started_at", "finished_at")


class JobRecord(BaseModel):
    """The decoded job hash. Timestamps are Unix seconds; JSON fields are decoded."""

    model_config = ConfigDict(extra="allow")

    id: str
    status: JobStatus
    request: dict[str, Any] | None = None
    upstream: str = "default"
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int = 0
    worker: str | None = None
    content: str = ""
    reasoning: list[dict[str, Any]] = Field(default_factory=list)
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    completion_id: str | None = None
    model: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    web_search: Any = None
    free_tier: Any = None
    cancel_requested: bool = False

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> JobRecord:
        """Decode the hash as read from Redis (strings) into a record."""
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if value == "":
                continue
            if name in JSON_FIELDS:
                values[name] = json.loads(value)
            elif name in FLOAT_FIELDS:
                values[name] = float(value)
            elif name == "cancel_requested":
                values[name] = value == "1"
            else:
                values[name] = value
        return cls.model_validate(values)
