"""An upstream's error body as the error object it carries (pure: text in, value out).

A provider answers an error with JSON (``{"error": {...}}``, or any JSON), or, as LiteLLM
does for a streamed request, with Server-Sent Events: a 5xx with content-type
``text/event-stream`` and ``data: {"error": {...}}``. Either way the record's
``error.detail`` is the error object; a body that is neither is kept as a short snippet.
"""

from __future__ import annotations

import json
from typing import Any

from worker.errors import ChatstreamError, snippet
from worker.protocol.sse import SSEDecoder

__all__ = ["error_detail"]

_NOT_JSON = object()


def error_detail(text: str, content_type: str) -> Any:
    """The error object of an error body (None when empty); see the module."""
    if not text:
        return None
    parsed = _json(text)
    if parsed is _NOT_JSON and _looks_like_sse(text, content_type):
        parsed = _first_json_event(text)
    if parsed is _NOT_JSON:
        return snippet(text)
    if isinstance(parsed, dict) and "error" in parsed:
        return parsed["error"]
    return parsed


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _looks_like_sse(text: str, content_type: str) -> bool:
    if content_type.partition(";")[0].strip().lower() == "text/event-stream":
        return True
    return text.lstrip().startswith(("data:", "event:"))


def _first_json_event(text: str) -> Any:
    """The first event whose data is JSON (the body may be cut: its last event ends here)."""
    try:
        events = SSEDecoder().feed_data(text.encode() + b"\n\n")
    except ChatstreamError:
        return _NOT_JSON
    for data in events:
        parsed = _json(data.decode("utf-8", "replace"))
        if parsed is not _NOT_JSON:
            return parsed
    return _NOT_JSON
