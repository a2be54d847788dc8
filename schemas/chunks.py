"""The upstream ``chat.completion.chunk`` wire format, as pydantic models.

Documentation and consumer-side validation only: the worker's hot path
(``worker.protocol.accumulator``) works on the plain dicts ``json.loads`` returns and applies the
same shapes. Every model allows extra fields, so unknown upstream fields pass through.

A stream is a sequence of SSE events whose ``data`` is one chunk as JSON, ended by
``data: [DONE]`` (not JSON). ``role`` arrives once, ``content`` fragments concatenate,
``finish_reason`` is null until the terminal chunk, then an optional usage chunk (empty
``choices``) precedes ``[DONE]``. A mid-stream failure is a final chunk with a top-level
``error``, an empty delta and ``finish_reason: "error"``, with no ``[DONE]`` after it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "error")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDelta(_Model):
    """A fragment of a function call: ``name`` once, ``arguments`` to concatenate."""

    name: str | None = None
    # a JSON string fragment; some providers send the whole arguments as an object
    arguments: str | dict[str, Any] | None = None


class ToolCallDelta(_Model):
    """A tool-call fragment; fragments with the same ``index`` build one call."""

    index: int | None = None
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class ReasoningDetail(_Model):
    """A reasoning fragment (``reasoning.text``, ``reasoning.summary``, ``reasoning.encrypted``).

    Consecutive fragments of the same type (and index) concatenate ``text`` / ``summary``
    until one brings a ``signature``, which ends the block; encrypted entries (``data``)
    stay whole.
    """

    type: str | None = None
    text: str | None = None
    summary: str | None = None
    data: str | None = None
    signature: str | None = None
    format: str | None = None
    id: str | None = None
    index: int | None = None


class ChoiceDelta(_Model):
    """The incremental update carried by ``choices[].delta``."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_details: list[ReasoningDetail] | None = None
    reasoning: str | None = None  # OpenRouter: plain reasoning text
    refusal: str | None = None


class Choice(_Model):
    index: int = 0  # with n > 1, which choice (each accumulates on its own)
    delta: ChoiceDelta = Field(default_factory=ChoiceDelta)
    finish_reason: str | None = None  # null until the terminal chunk; see FINISH_REASONS


class Usage(_Model):
    """Token usage; only on the trailing usage chunk (keep the last non-null, never sum)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None
    cost: float | None = None


class StreamError(_Model):
    """The top-level ``error`` object of a mid-stream error chunk."""

    code: int | str | None = None
    message: str | None = None
    metadata: dict[str, Any] | None = None


class ChatCompletionChunk(_Model):
    id: str | None = None  # stable across the stream
    object: str = "chat.completion.chunk"
    created: int | None = None  # unix seconds
    model: str | None = None
    choices: list[Choice] = Field(default_factory=list)
    usage: Usage | None = None
    web_search: dict[str, Any] | None = None
    free_tier: dict[str, Any] | None = None
    error: StreamError | None = None
    obfuscation: str | None = None  # OpenAI: random padding of the chunk's length; ignored
