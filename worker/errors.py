"""The chatstream exception tree.

Foreign exceptions (httpx, redis, json, pydantic) are translated once, at the module that
talks to them, with ``raise ... from exc``; everything above sees only these::

    ChatstreamError
    ├── ConfigError                 settings are invalid (start-up fails with one message)
    ├── InvalidJobError             a job payload or queue entry cannot be run (terminal)
    │   └── UnknownUpstreamError    the job names an upstream the settings do not define
    ├── JobNotFoundError            no record for that job id (expired or never enqueued)
    ├── RedisUnavailableError       Redis did not answer at start (down, or not Redis)
    ├── NotReplicatedError          too few replicas acknowledged a write in time (WAIT)
    ├── QueueFullError              the tenant has CHATSTREAM_MAX_QUEUED jobs waiting
    ├── StaleAttemptError           a fenced write lost: a newer attempt owns the job
    ├── ProtocolError               the upstream broke the SSE / chunk protocol (terminal)
    │   └── EventTooLargeError      one SSE event exceeded the configured size limit
    └── UpstreamError               the upstream call failed
        ├── RetryableUpstreamError  connection errors, 408/409/425/429/5xx: worth another try
        │   ├── UpstreamTimeoutError    connect / first byte / idle / whole-job timeout
        │   ├── TruncatedStreamError    the stream ended with neither [DONE] nor a finish_reason
        │   └── RetryableStreamError    an error chunk that says "try again" (overloaded, ...)
        └── TerminalUpstreamError   other 4xx, a 200 that is not text/event-stream
            └── MidStreamError          a chunk with a top-level error object

``retryable(exc)`` tells the two upstream branches apart for the retry policy.
Every error carries a short machine-readable ``code`` and renders to the JSON object stored
in the job record's ``error`` field via ``to_record()``; messages never contain secrets.
"""

from __future__ import annotations

from typing import Any

MAX_SNIPPET = 200


def snippet(data: bytes | str, limit: int = MAX_SNIPPET) -> str:
    """A printable, cut-short rendering of offending bytes for an error message."""
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    return repr(data if len(data) <= limit else data[:limit] + "…")


class ChatstreamError(Exception):
    code = "error"

    def __init__(self, message: str, *, detail: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.detail is not None:
            record["detail"] = self.detail
        return record


class ConfigError(ChatstreamError):
    code = "config"


class InvalidJobError(ChatstreamError):
    code = "invalid_job"


class UnknownUpstreamError(InvalidJobError):
    code = "unknown_upstream"


class JobNotFoundError(ChatstreamError):
    code = "job_not_found"


class RedisUnavailableError(ChatstreamError):
    code = "redis_unavailable"


class NotReplicatedError(ChatstreamError):
    code = "not_replicated"


class QueueFullError(ChatstreamError):
    """Enqueue refused, nothing written: the tenant has as many jobs waiting as
    ``CHATSTREAM_MAX_QUEUED`` allows (``waiting``). ``queued``: the ids ``enqueue_many``
    queued before it was refused (they stay queued)."""

    code = "queue_full"

    def __init__(
        self, message: str, *, tenant: str, waiting: int, queued: list[str] | None = None
    ) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.waiting = waiting
        self.queued = queued or []


class StaleAttemptError(ChatstreamError):
    code = "stale_attempt"


class ProtocolError(ChatstreamError):
    code = "protocol"


class EventTooLargeError(ProtocolError):
    code = "event_too_large"


class UpstreamError(ChatstreamError):
    """``status``: the HTTP status, when there was one; ``upstream``: the upstream's name
    (for metrics and logs; not stored in the record, whose job names it already)."""

    code = "upstream"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        detail: Any = None,
        upstream: str | None = None,
    ) -> None:
        super().__init__(message, detail=detail)
        self.status = status
        self.upstream = upstream

    def to_record(self) -> dict[str, Any]:
        record = super().to_record()
        if self.status is not None:
            record["status"] = self.status
        return record


class RetryableUpstreamError(UpstreamError):
    """``unreachable``: the upstream itself could not be reached (refused, reset, TLS, DNS,
    no HTTP response), as opposed to an answer about one model (a status, a timeout)."""

    code = "upstream_retryable"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        detail: Any = None,
        retry_after: float | None = None,
        upstream: str | None = None,
        unreachable: bool = False,
    ) -> None:
        super().__init__(message, status=status, detail=detail, upstream=upstream)
        self.retry_after = retry_after
        self.unreachable = unreachable


class UpstreamTimeoutError(RetryableUpstreamError):
    code = "upstream_timeout"


class TruncatedStreamError(RetryableUpstreamError):
    code = "truncated"


class RetryableStreamError(RetryableUpstreamError):
    """An error chunk after the 200 that says "try again": overloaded, rate limited, a
    server error (``worker.upstream.verdict``). Retried like a cut stream."""

    code = "upstream_stream_error"


class TerminalUpstreamError(UpstreamError):
    code = "upstream_terminal"


class MidStreamError(TerminalUpstreamError):
    """The upstream sent a chunk with a top-level ``error`` object."""

    code = "upstream_stream_error"


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, RetryableUpstreamError)
