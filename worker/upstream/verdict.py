"""What a failed try says about where the fault is, and whether another target may do better.

Pure: an exception (or a stream's error chunk) in, a verdict out. The grain is what a
failure takes down (docs/routing.md): the *upstream* when it could not be reached at all
(refused, reset, TLS, DNS: every model behind its URL is unreachable), the *target*
(upstream, model) when it answered about one model (a retryable HTTP status, no first byte in
time, an error chunk after its 200, a stream cut short). A request the upstream judged wrong
(another 4xx, an error chunk that is not retryable) is no fault of the target: no other
target sees it, except a context-length error where the route names a target for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from worker.errors import ChatstreamError, MidStreamError, RetryableUpstreamError
from worker.protocol.accumulator import error_status

RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})
# an error chunk's type or code that says "try again, maybe elsewhere" (OpenAI, Anthropic,
# OpenRouter, LiteLLM, Bedrock, Vertex spell them so)
_RETRYABLE_WORDS = re.compile(
    r"overload|rate.?limit|server.?error|internal|unavailable|timeout|timed.?out|capacity"
    r"|throttl|too.?many.?requests|api.?error|resource.?exhausted|busy",
    re.IGNORECASE,
)
_CONTEXT_WORDS = re.compile(
    r"context.?length|context.?window|maximum context|prompt is too long|too many tokens"
    r"|input is too long|reduce the length",
    re.IGNORECASE,
)


class Grain(Enum):
    UPSTREAM = "upstream"  # it could not be reached: every target on it is down
    TARGET = "target"  # it answered about this model


@dataclass(frozen=True, slots=True)
class Verdict:
    """``move``: another try (or target) may succeed; ``grain``: what the failure takes down
    (None: nothing, the request was at fault); ``context``: the prompt exceeds the model's
    context (a route's ``context_fallback`` may take it)."""

    move: bool
    grain: Grain | None
    context: bool = False


NOT_MOVED = Verdict(move=False, grain=None)


def judge(exc: ChatstreamError) -> Verdict:
    """The verdict on a failed try."""
    if isinstance(exc, RetryableUpstreamError):
        return Verdict(True, grain_of(exc))
    if isinstance(exc, MidStreamError):
        return judge_stream_error(exc.detail if isinstance(exc.detail, dict) else {})
    status = getattr(exc, "status", None)
    if isinstance(status, int) and _mentions_context(exc.message, exc.detail):
        return Verdict(False, None, context=True)
    return NOT_MOVED


def grain_of(exc: RetryableUpstreamError) -> Grain:
    """What a retryable failure takes down: the upstream when it could not be reached."""
    return Grain.UPSTREAM if exc.unreachable else Grain.TARGET


def judge_stream_error(error: dict[str, Any]) -> Verdict:
    """The verdict on an error chunk that ended a 200 stream (its top-level ``error``)."""
    status = error_status(error)
    words = " ".join(str(error.get(key, "")) for key in ("type", "code", "status"))
    if (status is not None and retryable_status(status)) or _RETRYABLE_WORDS.search(words):
        return Verdict(True, Grain.TARGET)
    if _mentions_context(error.get("message"), error):
        return Verdict(False, None, context=True)
    return NOT_MOVED


def retryable_status(status: int) -> bool:
    """408, 409, 425, 429 and every 5xx (529, "overloaded", included)."""
    return status in RETRYABLE_STATUSES or 500 <= status <= 599


def _mentions_context(message: Any, detail: Any) -> bool:
    text = f"{message} {detail}" if detail is not None else str(message)
    return bool(_CONTEXT_WORDS.search(text[:4096]))
