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

EXTRAS = ("web_search", "free_tier")
"""Provider extras the seeds name: the last non-null value, on the record and the terminal
entry of the events stream."""

OUTPUT_FIELDS = (
    "content",
    "refusal",
    "reasoning",
    "tool_calls",
    "choices",
    "finish_reason",
    "usage",
    "completion_id",
    "model",
    *EXTRAS,
)
"""The record fields the terminal write fills from the attempt's output (empty when there is
none); a requeue clears them. ``worker.protocol.accumulator.FinalMessage`` has an attribute of each
name (the extras in ``FinalMessage.extras``)."""

SERVED_FIELDS = ("served_upstream", "served_model")
"""Where the attempt that ended the job sent its request (written by the terminal write once
the job ran; a requeue clears them with ``OUTPUT_FIELDS``)."""

JSON_FIELDS = (
    "request",
    "reasoning",
    "tool_calls",
    "choices",
    "usage",
    "error",
    "metadata",
    *EXTRAS,
)
FLOAT_FIELDS = ("created_at", "started_at", "finished_at", "requeued_at", "dispatched_at")
FLAG_FIELDS = ("cancel_requested", "dead_pending")  # stored as "1"


class JobRecord(BaseModel):
    """The decoded job hash. Timestamps are Unix seconds; JSON fields are decoded."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(description="The job id (client-chosen or a random hex id).")
    status: JobStatus = Field(description="queued | running | succeeded | failed | cancelled.")
    request: dict[str, Any] | None = Field(
        None, description="The chat request as enqueued (JSON), sent upstream with stream: true."
    )
    upstream: str = Field("default", description="The configured upstream name the job uses.")
    tenant: str = Field("default", description="Who the job is for (fair shares of the fleet).")
    priority: str = Field("normal", description="high | normal | low, within its tenant.")
    created_at: float | None = Field(None, description="Enqueue time (Unix seconds).")
    dispatched_at: float | None = Field(
        None,
        description="When it left its tenant's queue (its fair share and its upstream's limits "
        "let it go; Redis time): dispatched_at - created_at is how long it waited for its turn.",
    )
    started_at: float | None = Field(None, description="Start of the latest attempt.")
    finished_at: float | None = Field(None, description="Time of the terminal status.")
    attempt: int = Field(0, description="The latest attempt number (0 until one starts).")
    worker: str | None = Field(None, description="The worker running (or that ran) the attempt.")
    content: str = Field("", description="The final message content (partial on failure).")
    refusal: str = Field("", description="The model's refusal message, when it refused.")
    reasoning: list[dict[str, Any]] = Field(
        default_factory=list, description="The merged reasoning_details entries."
    )
    tool_calls: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The final tool calls: {id, type, function: {name, arguments}}.",
    )
    choices: list[dict[str, Any]] = Field(
        default_factory=list,
        description="With n > 1, the other choices (index 1, 2, ...), each {index, role, "
        "content, refusal, reasoning, tool_calls, finish_reason}; the top-level fields are "
        "choice 0's.",
    )
    finish_reason: str | None = Field(None, description="The upstream's finish_reason.")
    usage: dict[str, Any] | None = Field(
        None, description="Token usage: the last non-null usage the upstream sent."
    )
    error: dict[str, Any] | None = Field(
        None, description="On failure: {code, message, status?, detail?}."
    )
    completion_id: str | None = Field(None, description="The upstream's completion id.")
    model: str | None = Field(None, description="The model the upstream reported.")
    served_upstream: str | None = Field(
        None,
        description="The upstream of the attempt that ended the job (on a route: the target "
        "that served, or failed, it).",
    )
    served_model: str | None = Field(
        None, description="The model that attempt asked its upstream for (a route's target's)."
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Caller metadata given at enqueue (JSON)."
    )
    web_search: Any = Field(None, description="Provider extra, when the upstream sent it.")
    free_tier: Any = Field(None, description="Provider extra, when the upstream sent it.")
    cancel_requested: bool = Field(False, description="A cancel was requested.")
    traceparent: str | None = Field(
        None, description="W3C traceparent of the span that enqueued the job (OpenTelemetry)."
    )
    tracestate: str | None = Field(None, description="W3C tracestate stored with traceparent.")
    baggage: str | None = Field(
        None,
        description="W3C baggage of the enqueueing context; sent upstream only where the "
        "upstream's forward_baggage says so.",
    )
    # bookkeeping of the queue and the attempts (docs/redis.md#the-job-record)
    queue_entry: str | None = Field(None, description="The queue entry id of the enqueue.")
    entry: str | None = Field(None, description="The queue entry the latest attempt runs under.")
    start_token: str | None = Field(
        None, description="Identifies the latest attempt's start (a retried start reuses it)."
    )
    delivery: int | None = Field(
        None,
        description="Delivery count of the queue entry the latest attempt started from (a "
        "start from an older delivery of that entry is refused).",
    )
    seq: int = Field(0, description="Sequence number of the attempt's last delta entry.")
    releases: int = Field(
        0, description="Attempts handed back unfinished (they do not count against the budget)."
    )
    dead_pending: bool = Field(
        False, description="Failed for exhausted attempts, not yet on the dead-letter stream."
    )
    dead_letter: str | None = Field(None, description="The job's dead-letter entry id.")
    budget_base: int = Field(0, description="Attempts before the last requeue (not counted).")
    requeued_at: float | None = Field(None, description="When an operator last requeued it.")

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
            elif name in FLAG_FIELDS:
                values[name] = value == "1"
            else:
                values[name] = value
        return cls.model_validate(values)
