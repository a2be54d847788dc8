"""Configuration: environment variables with the prefix ``CHATSTREAM_`` (or a ``.env`` file).

See docs/configuration.md for the reference. API keys are ``SecretStr``: they never reach
Redis, logs or error messages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import ConfigError, UnknownUpstreamError

DEFAULT_UPSTREAM = "default"


class Upstream(BaseModel):
    """One named OpenAI-compatible endpoint; ``url`` is the base ending in ``/v1``."""

    url: str = Field(pattern=r"^https?://")
    api_key: SecretStr | None = None
    headers: dict[str, str] = Field(default_factory=dict)

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/") + "/chat/completions"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CHATSTREAM_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    redis_url: str = Field("redis://127.0.0.1:6379/0", pattern=r"^(redis|rediss|unix)://")
    prefix: str = Field("chatstream", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    upstream_url: str = Field("http://127.0.0.1:8400/v1", pattern=r"^https?://")
    upstream_api_key: SecretStr | None = None
    upstreams: dict[str, Upstream] = Field(default_factory=dict)

    concurrency: int = Field(256, ge=1, le=100_000)
    lease_seconds: float = Field(30.0, gt=0)
    retention_seconds: int = Field(86_400, ge=1)
    block_ms: int = Field(5_000, ge=1)

    connect_timeout: float = Field(10.0, gt=0)
    first_byte_timeout: float = Field(60.0, gt=0)
    idle_timeout: float = Field(60.0, gt=0)
    job_timeout: float = Field(900.0, gt=0)

    retry_attempts: int = Field(4, ge=1, le=100)
    retry_initial_backoff: float = Field(0.5, ge=0)
    retry_max_backoff: float = Field(20.0, ge=0)
    max_attempts: int = Field(3, ge=1, le=100)
    retry_after_output: bool = False

    max_request_bytes: int = Field(1_048_576, ge=1024)
    max_event_bytes: int = Field(8 * 1_048_576, ge=1024)
    publish_max_batch: int = Field(1_000, ge=1)

    shutdown_grace_seconds: float = Field(25.0, ge=0)
    metrics_port: int | None = Field(None, ge=0, le=65_535)
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _default_upstream_not_shadowed(self) -> Settings:
        if DEFAULT_UPSTREAM in self.upstreams and "upstream_url" in self.model_fields_set:
            raise ValueError("set either CHATSTREAM_UPSTREAM_URL or upstreams.default, not both")
        return self

    def upstream(self, name: str) -> Upstream:
        """The named upstream; the job can only choose among these, never a URL."""
        if name in self.upstreams:
            return self.upstreams[name]
        if name == DEFAULT_UPSTREAM:
            return Upstream(url=self.upstream_url, api_key=self.upstream_api_key)
        raise UnknownUpstreamError(
            f"unknown upstream {name!r}; configured: {self.upstream_names()}"
        )

    def upstream_names(self) -> list[str]:
        return sorted({DEFAULT_UPSTREAM, *self.upstreams})


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, or one ConfigError naming every invalid field."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(
            f"CHATSTREAM_{'_'.join(str(p) for p in err['loc']).upper() or 'SETTINGS'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from None
