"""What a backend enqueues: an OpenAI-compatible chat request and the job around it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

JOB_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"


class ChatMessage(BaseModel):
    """One message of the conversation; unknown fields (name, tool_call_id, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, description="system | user | assistant | tool | ...")
    content: Any = Field(None, description="A string or a list of content parts.")


class ChatRequest(BaseModel):
    """An OpenAI-compatible ``/v1/chat/completions`` body.

    Only what the worker relies on is checked; every other field (temperature, tools,
    reasoning, provider options, ...) passes through to the upstream unchanged. The worker
    forces ``stream: true`` and ``stream_options.include_usage: true``.
    """

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="The model name, passed to the upstream.")
    messages: list[ChatMessage] = Field(
        min_length=1, description="The conversation, OpenAI chat format."
    )

    @field_validator("model")
    @classmethod
    def _model_is_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model must not be blank")
        return value

    def upstream_body(self) -> dict[str, Any]:
        """The body sent upstream: the request as given, streaming with usage."""
        body = self.model_dump(mode="json", exclude_none=False)
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream"] = True
        body["stream_options"] = options
        return body


class JobSpec(BaseModel):
    """The job as enqueued: the request plus routing and caller metadata."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(
        pattern=JOB_ID_PATTERN, description="The job id; enqueueing the same id twice is a no-op."
    )
    request: ChatRequest = Field(description="The OpenAI-compatible chat request body.")
    upstream: str = Field(
        default="default",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="A configured upstream name (never a URL).",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Caller metadata, stored on the record."
    )
