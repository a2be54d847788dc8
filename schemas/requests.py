"""What a backend enqueues: an OpenAI-compatible chat request and the job around it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

JOB_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
Priority = Literal["high", "normal", "low"]
PRIORITY_RANK: dict[str, int] = {"high": 0, "normal": 1, "low": 2}
# How deeply a request (and a job's metadata) may nest, in JSON levels: the body object is
# level 1, a message's ``content`` list level 4. A worker reads the request back from the
# record with pydantic_core's JSON parser, which stops at 200 levels, and the record's
# JSON is written by pydantic, which stops near 255: at 128 both have room to spare, and
# real requests (tool schemas included) stay far below it (docs/decisions.md, 51).
MAX_NESTING = 128


def nesting_depth(value: Any, stop_after: int = MAX_NESTING) -> int:
    """How many JSON levels ``value`` has (a scalar 0, ``[]`` and ``{}`` 1, a model like the
    dict of its fields); counted without recursion, a level at a time, and only up to
    ``stop_after + 1``, so a hostile value costs no more than a walk to that depth."""
    depth = 0
    level: list[Any] = [value] if isinstance(value, _CONTAINERS) else []
    while level:
        depth += 1
        if depth > stop_after:
            return depth
        below: list[Any] = []
        for item in level:
            kind = type(item)
            if kind is dict:
                below += item.values()
            elif kind is list or kind is tuple:
                below += item
            else:  # a model (its fields), or a subclass of dict, list or tuple
                found = dict(item) if isinstance(item, BaseModel) else item
                below += found.values() if isinstance(found, dict) else found
        # (scalars by their exact type first: the common case, and cheaper than isinstance)
        level = [c for c in below if type(c) not in _SCALARS and isinstance(c, _CONTAINERS)]
    return depth


_CONTAINERS = (dict, list, tuple, BaseModel)
_SCALARS = frozenset({str, int, float, bool, type(None)})


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

    def prompt_tokens_estimate(self, json_length: int | None = None) -> int:
        """About how many tokens the prompt is (its JSON's length over four, plus a few per
        message): what a tokens-per-minute limit admits a request on before the upstream
        reports its usage (docs/decisions.md, 48). ``json_length``: the length of the
        request's JSON when the caller has it already (the estimate counts the whole)."""
        if json_length is None:
            json_length = len(self.model_dump_json(include={"messages", "tools"}))
        return json_length // 4 + 4 * len(self.messages)

    def max_output_tokens(self) -> int | None:
        """The request's own bound on completion tokens, if it sets one."""
        extra = self.model_extra or {}
        for name in ("max_completion_tokens", "max_tokens"):
            value = extra.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

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
    tenant: str = Field(
        default="default",
        pattern=TENANT_PATTERN,
        description="Who the job is for: free capacity is shared fairly among tenants.",
    )
    priority: Priority = Field(
        default="normal", description="Within a tenant: high before normal before low."
    )
