"""Configuration: environment variables with the prefix ``CHATSTREAM_`` (or a ``.env`` file).

See docs/configuration.md for the reference. API keys are ``SecretStr``: they never reach
Redis, logs or error messages.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from schemas.requests import TENANT_PATTERN
from worker.errors import ConfigError, UnknownUpstreamError
from worker.urls import parse_redis_url

DEFAULT_UPSTREAM = "default"
ROUTE_PATTERN = r"[A-Za-z0-9_.:/-]{1,128}"
LIMIT_FIELDS = {"max_concurrent", "requests_per_minute", "tokens_per_minute"}


class UpstreamLimits(BaseModel):
    """An upstream's limits across the whole fleet of a prefix (None: unlimited)."""

    max_concurrent: int | None = Field(
        None, ge=1, description="Streams open at once to it, across all workers."
    )
    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests sent to it in any 60 s, across all workers."
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt + completion tokens in any 60 s, across all workers (a request "
        "is admitted on an estimate, then counted at its reported usage).",
    )

    @property
    def limited(self) -> bool:
        return any(
            value is not None
            for value in (self.max_concurrent, self.requests_per_minute, self.tokens_per_minute)
        )


class Upstream(UpstreamLimits):
    """One named OpenAI-compatible endpoint; ``url`` is the base ending in ``/v1``."""

    url: str = Field(pattern=r"^https?://", description="Base URL ending in /v1.")
    api_key: SecretStr | None = Field(None, description="Sent as a Bearer token.")
    headers: dict[str, str] = Field(
        default_factory=dict, description="Extra request headers (e.g. HTTP-Referer)."
    )
    provider: str = Field(
        "openai",
        pattern=r"^[a-z0-9_.]{1,64}$",
        description="`gen_ai.provider.name` on traces and OTLP metrics: an OpenTelemetry "
        "well-known value (openai, azure.ai.openai, groq, mistral_ai, ...) or your own.",
    )
    forward_baggage: bool = Field(
        False,
        description="Send the W3C `baggage` a job was enqueued with to this upstream, beside "
        "`traceparent` (off: baggage may hold internal data a third party must not see).",
    )

    @property
    def completions_url(self) -> str:
        return self.url.rstrip("/") + "/chat/completions"


class RouteTarget(BaseModel):
    """One deployment a route may send a job to: an upstream, the model it is asked for
    there (the route's name when unset), and its share under the ``weighted`` strategy."""

    model_config = {"extra": "forbid"}

    upstream: str = Field(description="A configured upstream's name.")
    model: str | None = Field(
        None, min_length=1, max_length=256, description="The model sent to this upstream."
    )
    weight: float = Field(1.0, description="Its share of the jobs (`weighted`), > 0.")

    @field_validator("weight")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not 0 < value <= 1_000_000:
            raise ValueError(f"weight {value} is not in (0, 1e6]")
        return value


class Route(BaseModel):
    """A model name served by several targets (docs/routing.md)."""

    model_config = {"extra": "forbid"}

    targets: list[RouteTarget] = Field(
        min_length=1, max_length=32, description="The targets, in the order of preference."
    )
    strategy: Literal["fallback", "weighted"] = Field(
        "fallback",
        description="`fallback`: the first target that is up and has room; `weighted`: "
        "among those, by weight.",
    )
    context_fallback: RouteTarget | None = Field(
        None,
        description="Where a job goes when a target answers that its prompt exceeds the "
        "model's context (LiteLLM's context_window_fallbacks).",
    )

    def target_model(self, target: RouteTarget, name: str) -> str:
        return target.model or name

    def all_targets(self) -> list[RouteTarget]:
        """Its targets, then its context fallback: a target's index in this list is the one
        the scheduler and the queue entries use."""
        return [*self.targets, *([self.context_fallback] if self.context_fallback else [])]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CHATSTREAM_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL: redis://, rediss:// (TLS) or unix:// for one server (a "
        "Cluster node is detected); redis+cluster://h:p,h:p for a Cluster; "
        "redis+sentinel://h:p,h:p/<service>[/<db>] for Sentinel (rediss+... with TLS). User "
        "and password for ACLs go in the URL.",
    )
    prefix: str = Field(
        "chatstream",
        pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
        description="Prefix of every Redis key; workers and clients must agree on it.",
    )
    upstream_url: str = Field(
        "http://127.0.0.1:8400/v1",
        pattern=r"^https?://",
        description="Base URL (ending in /v1) of the upstream named `default`.",
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="API key of the `default` upstream, sent as a Bearer token."
    )
    upstreams: dict[str, Upstream] = Field(
        default_factory=dict,
        description="Named upstreams as JSON: {name: {url, api_key?, headers?, provider?, "
        "forward_baggage?, max_concurrent?, requests_per_minute?, tokens_per_minute?}}; a "
        "job picks one by name.",
    )
    routes: dict[str, Route] = Field(
        default_factory=dict,
        description="Routes as JSON: {name: {targets: [{upstream, model?, weight?}, ...], "
        "strategy?: fallback|weighted, context_fallback?: {upstream, model?}}}; a job uses "
        "one when its request's model, or its upstream, is the route's name "
        "(docs/routing.md).",
    )
    breaker_cooldown: float = Field(
        1.0,
        gt=0,
        le=600,
        description="How long every worker skips a route's target after it failed, seconds "
        "(doubling with each failed probe, up to `breaker_max_cooldown`; a Retry-After "
        "is honoured up to 60 s).",
    )
    breaker_max_cooldown: float = Field(
        8.0,
        gt=0,
        le=600,
        description="The longest a route's failing target is skipped between two probes, seconds.",
    )
    upstream_max_concurrent: int | None = Field(
        None,
        ge=1,
        description="Streams open at once to the `default` upstream, across every worker of "
        "the prefix (unset: unlimited).",
    )
    upstream_requests_per_minute: int | None = Field(
        None,
        ge=1,
        description="Requests to the `default` upstream in any 60 s, across every worker "
        "(retries included; unset: unlimited).",
    )
    upstream_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt + completion tokens of the `default` upstream in any 60 s, "
        "across every worker (admitted on an estimate, counted at the reported usage).",
    )
    requests_burst_seconds: float = Field(
        0.5,
        ge=0,
        le=60,
        description="How much of a requests-per-minute limit may go out at once, as seconds "
        "of its rate (at least one request): requests are otherwise spread evenly over the "
        "minute, since providers enforce a per-minute limit over shorter periods too.",
    )
    completion_tokens_estimate: int = Field(
        1_024,
        ge=1,
        description="Completion tokens a request without `max_tokens` is assumed to use "
        "when a tokens-per-minute limit admits it (its real usage is counted after).",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description='Shares of the fleet per tenant as JSON, e.g. {"live": 4}: among '
        "tenants with waiting jobs, free capacity goes round-robin in proportion (default "
        "weight 1).",
    )
    max_queued: int | None = Field(
        None,
        ge=1,
        description="Jobs one tenant may have waiting for a worker (in its queues, or moved "
        "into the queue stream and not yet read; per queue shard: this / shards, rounded "
        "up); beyond it enqueue is refused (the gateway answers 429). Unset: unbounded.",
    )

    concurrency: int = Field(
        256,
        ge=1,
        le=100_000,
        description="Jobs in flight per worker process (also its upstream connection limit).",
    )
    lease_seconds: float = Field(
        30.0,
        gt=0,
        description="Lease on a running job, renewed every lease/3; a job whose worker "
        "stopped renewing is taken over after this long (sooner when its heartbeat stops).",
    )
    heartbeat_seconds: float = Field(
        1.0,
        gt=0,
        description="How often a worker writes its heartbeat and looks for workers whose "
        "heartbeat stopped.",
    )
    heartbeat_timeout: float = Field(
        3.0,
        gt=0,
        description="A worker silent this long is dead: its jobs are taken over at once and "
        "rerun (a live worker's event loop may stall for less without losing its jobs).",
    )
    retention_seconds: int = Field(
        86_400,
        ge=1,
        description="TTL of job records and events streams, counted from the last state change.",
    )
    jobs_index_max: int = Field(
        1_000_000,
        ge=0,
        le=100_000_000,
        description="Most jobs the `<prefix>:jobs` index keeps for `chatstream jobs` (the "
        "newest; older than the retention are dropped too; about 140 bytes each); 0: no index.",
    )
    redis_max_connections: int = Field(
        128,
        ge=4,
        le=10_000,
        description="Connections per process to Redis at most; beyond it a Redis call waits "
        "for a free one (a blocking pool) instead of failing.",
    )
    queue_shards: int = Field(
        1,
        ge=1,
        le=256,
        description="Streams the queue is split over, each on its own Cluster slot; jobs "
        "are spread by id and workers read every shard. Producers, workers and clients must "
        "agree on it (docs/scaling.md).",
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        le=16,
        description="Replicas that must acknowledge an enqueue and a job's terminal write "
        "(Redis WAIT) before they count as done; 0: no waiting (asynchronous replication, "
        "docs/reliability.md).",
    )
    redis_wait_timeout_ms: int = Field(
        2_000,
        ge=1,
        le=10_000,
        description="How long one WAIT for `redis_wait_replicas` replicas may take, ms (below "
        "the Redis socket timeout).",
    )
    block_ms: int = Field(
        2_000,
        ge=1,
        le=60_000,
        description="How long one queue read (XREADGROUP) waits for jobs; kept below the "
        "Redis socket timeout (redis-py's default is 5 s).",
    )

    connect_timeout: float = Field(
        10.0, gt=0, description="Upstream TCP/TLS connect timeout, seconds."
    )
    first_byte_timeout: float = Field(
        60.0,
        gt=0,
        description="Per try: sending the request until the first body byte, seconds.",
    )
    idle_timeout: float = Field(
        60.0, gt=0, description="Longest silence allowed mid-stream, seconds (retryable)."
    )
    job_timeout: float = Field(
        900.0, gt=0, description="Longest a worker spends on one job, retries included, seconds."
    )

    retry_attempts: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Tries of the upstream call before its first byte (the first included); "
        "unset: retried until the job's timeout (an upstream outage fails no job that has "
        "time left).",
    )
    retry_initial_backoff: float = Field(
        0.5, ge=0, description="Backoff multiplier: exponential with full jitter, seconds."
    )
    retry_max_backoff: float = Field(
        20.0,
        ge=0,
        description="Longest backoff, seconds: while an upstream is down, one job tries it "
        "at least this often; a Retry-After is honoured up to max(this, 60).",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="Most times a job is streamed (retryable failures after the first "
        "byte) or started without finishing (crashed workers); then it fails.",
    )
    retry_after_output: bool = Field(
        False,
        description="Also retry a retryable failure after deltas were published, as a new "
        "attempt that starts with a `reset` event.",
    )

    max_waiting: int = Field(
        1024,
        ge=0,
        description="Jobs a worker holds beyond `concurrency` while they wait for an "
        "upstream that is down (they give their slot back meanwhile); at the limit it "
        "takes no new jobs.",
    )

    max_request_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body (JSON) a job may carry."
    )
    max_event_bytes: int = Field(
        8 * 1_048_576, ge=1024, description="Largest single SSE event from the upstream."
    )
    publish_max_batch: int = Field(
        1_000, ge=1, description="Most jobs written per publish round trip (pipeline)."
    )
    wake_tick_ms: float = Field(
        12.0,
        ge=0,
        le=20,
        description="While jobs run, the reads of streaming upstream bodies and the "
        "publisher's replies that nothing waits for are handled at most once per this many "
        "ms, so they share one wake-up (CPU per token at light load; adds at most this "
        "much latency to a token, none to a job's start or end or a request); 0 turns it off.",
    )

    shutdown_grace_seconds: float = Field(
        25.0,
        ge=0,
        description="On SIGTERM, how long running jobs may finish before they are "
        "handed back to the queue.",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65_535,
        description="Port of the HTTP /metrics, /healthz and /readyz endpoints (unset: off; "
        "0: a free port). With `worker --processes N`, child i serves on this port + i.",
    )
    metrics_host: str = Field(
        "0.0.0.0", description="Address the metrics and health endpoints listen on."
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="Event loop: `auto` runs uvloop when it is installed "
        "(`pip install 'chatstream[fast]'`), else asyncio's.",
    )
    redis_parser: Literal["auto", "hiredis", "python"] = Field(
        "auto",
        description="Redis reply parser: `auto` uses hiredis when it is installed "
        "(`chatstream[fast]`), else redis-py's pure-Python one.",
    )
    http_transport: Literal["auto", "httptools", "httpx"] = Field(
        "auto",
        description="Upstream HTTP transport under httpx: `auto` uses chatstream's httptools "
        "transport when httptools is installed (`chatstream[fast]`) and no proxy is "
        "configured in the environment, else httpx's own.",
    )
    metrics_max_models: int = Field(
        50,
        ge=1,
        le=10_000,
        description="Distinct `model` label values of the token counters per worker process "
        "(a bound on metric cardinality); later models are counted as `other`.",
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level."
    )

    gateway_host: str = Field("127.0.0.1", description="Address `chatstream gateway` listens on.")
    gateway_port: int = Field(8300, ge=0, le=65_535, description="Port of `chatstream gateway`.")
    gateway_api_keys: SecretStr | None = Field(
        None,
        description="The gateway's API keys, comma-separated; an entry `sha256:<hex>` is the "
        "SHA-256 of a key, so the key itself need not be stored. Required by the gateway.",
    )
    gateway_max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body the gateway accepts (413 beyond)."
    )
    gateway_max_streams_per_key: int = Field(
        64,
        ge=1,
        description="Open event streams and waiting requests per API key and gateway process "
        "(429 beyond).",
    )
    gateway_jobs_per_minute: int = Field(
        120,
        ge=0,
        description="Jobs one API key may create per minute, across gateway processes "
        "(429 beyond; 0: no limit).",
    )
    gateway_max_connections: int = Field(
        4_000,
        ge=1,
        description="Open event streams and waiting requests per gateway process (503 beyond).",
    )
    gateway_cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Origins allowed to call the gateway from a browser, comma-separated "
        "(empty: CORS off).",
    )
    gateway_keepalive_seconds: float = Field(
        15.0, gt=0, description="A keep-alive comment goes to an idle event stream this often."
    )
    gateway_send_timeout: float = Field(
        60.0,
        gt=0,
        description="An event stream whose client accepts no bytes for this long is closed, "
        "seconds.",
    )
    gateway_client_buffer_bytes: int = Field(
        262_144,
        ge=16_384,
        description="Bytes of an event stream the gateway holds for one client that has not "
        "taken them yet (entries waiting for it, and the frame its connection has not "
        "sent); a client that falls further behind is dropped and resumes from its last "
        "event id.",
    )
    gateway_head_timeout: float = Field(
        10.0,
        gt=0,
        description="A connection whose request line and headers have not all arrived within "
        "this many seconds (of connecting, or of the previous response's end) is closed.",
    )

    dashboard_host: str = Field(
        "127.0.0.1", description="Address `chatstream dashboard` listens on."
    )
    dashboard_port: int = Field(
        8310, ge=0, le=65_535, description="Port of `chatstream dashboard`."
    )
    dashboard_keys: SecretStr | None = Field(
        None,
        description="Keys that allow the dashboard's actions (cancel, requeue, delete, pause) "
        "and show job content, comma-separated (`name=key` names who acted in the log; "
        "`sha256:<hex>` is the SHA-256 of a key). Unset: the dashboard is read-only.",
    )

    @field_validator("gateway_cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [origin.strip() for origin in value.split(",") if origin.strip()]
        return value

    @field_validator("log_level", "log_format", mode="before")
    @classmethod
    def _any_case(cls, value: object, info: ValidationInfo) -> object:
        """``info`` is ``INFO``; ``JSON`` is ``json``."""
        if not isinstance(value, str):
            return value
        return value.upper() if info.field_name == "log_level" else value.lower()

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, value: str) -> str:
        try:
            parse_redis_url(value)
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("CHATSTREAM_REDIS_URL: ")) from None
        return value

    @model_validator(mode="after")
    def _heartbeat_outlives_its_interval(self) -> Settings:
        if self.heartbeat_timeout < 2 * self.heartbeat_seconds:
            raise ValueError("heartbeat_timeout must be at least twice heartbeat_seconds")
        return self

    @field_validator("tenant_weights")
    @classmethod
    def _weights_are_positive(cls, value: dict[str, float]) -> dict[str, float]:
        for tenant, weight in value.items():
            if not re.match(TENANT_PATTERN, tenant):
                raise ValueError(f"tenant {tenant!r}: letters, digits, _ . - (1 to 64)")
            if not 0 < weight <= 1_000_000:
                raise ValueError(f"tenant {tenant!r}: weight {weight} is not in (0, 1e6]")
        return value

    @model_validator(mode="after")
    def _default_upstream_not_shadowed(self) -> Settings:
        if DEFAULT_UPSTREAM in self.upstreams and "upstream_url" in self.model_fields_set:
            raise ValueError("set either CHATSTREAM_UPSTREAM_URL or upstreams.default, not both")
        return self

    @model_validator(mode="after")
    def _routes_name_known_upstreams(self) -> Settings:
        """One line naming the setting for a route that cannot work."""
        upstreams = set(self.upstream_names())
        for name, route in self.routes.items():
            where = f"CHATSTREAM_ROUTES: route {name!r}"
            if not re.fullmatch(ROUTE_PATTERN, name):
                raise ValueError(f"{where}: a name of letters, digits, _ . : / - (1 to 128)")
            if name in upstreams:
                raise ValueError(f"{where} is named like an upstream: rename one of them")
            for index, target in enumerate(route.all_targets()):
                if target.upstream not in upstreams:
                    which = f"target {index}" if index < len(route.targets) else "context_fallback"
                    raise ValueError(
                        f"{where} {which}: unknown upstream {target.upstream!r} (configured: "
                        f"{sorted(upstreams)})"
                    )
        if self.breaker_max_cooldown < self.breaker_cooldown:
            raise ValueError("CHATSTREAM_BREAKER_MAX_COOLDOWN must be at least the cooldown")
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

    def route_targets(self) -> list[tuple[str, str, str]]:
        """Every (route, upstream, model) the routes may send a job to."""
        found = []
        for name, route in self.routes.items():
            for target in route.all_targets():
                found.append((name, target.upstream, route.target_model(target, name)))
        return found

    def upstream_names(self) -> list[str]:
        return sorted({DEFAULT_UPSTREAM, *self.upstreams})

    def upstream_limits(self) -> dict[str, UpstreamLimits]:
        """The fleet-wide limits of every upstream that has any."""
        limits = {
            name: UpstreamLimits.model_validate(upstream.model_dump(include=LIMIT_FIELDS))
            for name, upstream in self.upstreams.items()
        }
        if DEFAULT_UPSTREAM not in self.upstreams:
            limits[DEFAULT_UPSTREAM] = UpstreamLimits(
                max_concurrent=self.upstream_max_concurrent,
                requests_per_minute=self.upstream_requests_per_minute,
                tokens_per_minute=self.upstream_tokens_per_minute,
            )
        return {name: limit for name, limit in limits.items() if limit.limited}


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, or one ConfigError naming every invalid variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(_problem(err["loc"], err["msg"]) for err in exc.errors())
        raise ConfigError(f"invalid settings: {problems}") from None
    except SettingsError as exc:  # a value that is not JSON where JSON is expected
        raise ConfigError(f"invalid settings: {_unparsable(exc)}") from None


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    """``CHATSTREAM_X: what is wrong``; a check across settings names its variable itself."""
    own = message.removeprefix("Value error, ")
    if not loc and own.startswith("CHATSTREAM_"):
        return own
    return f"{variable_name(loc)}: {message}"


# CHATSTREAM_* variables that are not settings: set by chatstream for its own processes
SUPERVISOR_PID_VARIABLE = "CHATSTREAM_SUPERVISOR_PID"  # a supervised worker's (supervisor.py)
OTHER_VARIABLES = frozenset({SUPERVISOR_PID_VARIABLE, "CHATSTREAM_MOCK_CONFIG"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``CHATSTREAM_*`` variables that name no setting (a typo is otherwise silently
    ignored), each with the closest setting's variable when one is close:
    ``CHATSTREAM_CONCURENCY (did you mean CHATSTREAM_CONCURRENCY?)``."""
    known = {f"CHATSTREAM_{name.upper()}" for name in Settings.model_fields}
    nested = {f"CHATSTREAM_UPSTREAMS__{name.upper()}" for name in Upstream.model_fields}
    found = []
    for variable in sorted(v for v in environ if v.upper().startswith("CHATSTREAM_")):
        name = variable.upper()
        head, _, rest = name.partition("__")  # CHATSTREAM_UPSTREAMS__SLOW__URL: nested
        if name in OTHER_VARIABLES or (head in known and head != "CHATSTREAM_UPSTREAMS"):
            continue
        upstream_field = f"{head}__{rest.partition('__')[2]}"
        if head in known and (not rest or (rest.count("__") == 1 and upstream_field in nested)):
            continue
        close = _closest(name, head, rest, known)
        found.append(variable + (f" (did you mean {close}?)" if close else ""))
    return found


def _closest(name: str, head: str, rest: str, known: set[str]) -> str | None:
    """The setting's variable ``name`` is closest to (a nested upstream field's among its
    upstream's), if one is close."""
    candidates = sorted(known)
    if head == "CHATSTREAM_UPSTREAMS" and "__" in rest:
        upstream = rest.partition("__")[0]
        candidates = [f"{head}__{upstream}__{field.upper()}" for field in Upstream.model_fields]
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.8)
    return close[0] if close else None


def variable_name(loc: tuple[int | str, ...]) -> str:
    """The variable that sets ``loc``: ``CHATSTREAM_UPSTREAMS__LOCAL__URL`` for a nested
    key (``__`` is the nesting delimiter), ``CHATSTREAM_SETTINGS`` for the whole."""
    return "CHATSTREAM_" + ("__".join(str(part) for part in loc).upper() or "SETTINGS")


def _unparsable(exc: SettingsError) -> str:
    """``CHATSTREAM_UPSTREAMS: not valid JSON (Expecting value: ...)`` from pydantic-settings'
    ``error parsing value for field "upstreams" from source "EnvSettingsSource"``."""
    field, _, rest = str(exc).partition('field "')[2].partition('"')
    where = " (in .env)" if "DotEnv" in rest else ""
    cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
    name = variable_name((field,)) if field else "a setting"
    return f"{name}{where}: not valid JSON{cause}"
