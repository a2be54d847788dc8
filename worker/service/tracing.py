"""The worker's OpenTelemetry: one span per attempt, the GenAI client metrics.

The span follows the GenAI client inference span (``chat <model>``, kind CLIENT; decision
55 names the conventions' version); it is a child of the trace context stored with the job
at enqueue, and current while the attempt runs, so the upstream request carries its
``traceparent`` and the job's JSON log lines its ids. What it carries is decided at the
attempt's start, its request, its retries and resets, and its terminal write: never per
token, and never the prompt or the reply.

The pipeline calls the same hooks whether the process traces or not: :class:`NoTracing`
does nothing and imports nothing; :class:`Tracing` (built by :func:`tracing_for_process`
when a TracerProvider is set) needs the OpenTelemetry API. Metric attributes are bounded
like the Prometheus labels: a model beyond the first ``metrics_max_models`` is ``other``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard
from urllib.parse import urlsplit

from worker import package_version, telemetry
from worker.errors import ChatstreamError, UnknownUpstreamError
from worker.settings import Settings

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from worker.service.metrics import JobTiming, Metrics
    from worker.service.pipeline import Attempt, Outcome
    from worker.store.publisher import Terminal
    from worker.store.records import Started

OPERATION = "chat"
MAX_STATUS_MESSAGE = 300
END_BATCH_SECONDS = 0.25  # runs that end within this time end their spans together
MAX_ATTRIBUTE_SETS = 256  # metric attribute sets kept (models are bounded, error codes not)
# the conventions' advised bucket boundaries: tokens, and seconds (duration and first chunk)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
SECONDS_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                   40.96, 81.92)  # fmt: skip
REQUEST_ATTRIBUTES = {  # request body field -> span attribute (numbers only, never text)
    "max_completion_tokens": "gen_ai.request.max_tokens",
    "max_tokens": "gen_ai.request.max_tokens",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "seed": "gen_ai.request.seed",
}

Work = Callable[[], Awaitable["Outcome"]]


class NoTracing:
    """The hooks when this process does not trace: nothing happens, nothing is imported."""

    async def run(self, job: Attempt, started: Started, work: Work) -> Outcome:
        """Run the attempt (``work``), in its span when tracing."""
        return await work()

    def requested(self, body: dict[str, Any]) -> None:
        """The attempt's upstream body is known (its model names the span)."""

    def routed(self, route: str, upstream: str) -> None:
        """A route's target was chosen: its upstream is the span's server from now on."""

    def retried(self, stage: str, exc: BaseException, wait: float | None = None) -> None:
        """A retry: ``upstream`` before the first byte, ``stream`` of the whole stream."""

    def reset(self, attempt: int) -> None:
        """A new attempt of the job started within this run (its stream got a ``reset``)."""

    def ending(self, terminal: Terminal) -> None:
        """The terminal write is about to go out; a traced one names its span."""

    def flush(self) -> None:
        """End the spans of runs that ended (a traced process ends them in batches)."""


@dataclass(frozen=True, slots=True)
class Server:
    """What the spans and metrics say of an upstream: provider, host, port."""

    provider: str
    address: str | None = None
    port: int | None = None

    def attributes(self) -> dict[str, Any]:
        found: dict[str, Any] = {"gen_ai.provider.name": self.provider}
        if self.address is not None:
            found["server.address"] = self.address
        if self.port is not None:
            found["server.port"] = self.port
        return found


@dataclass(slots=True)
class _Traced:
    """One traced run of an attempt, as its hooks see it (a context variable of its task).

    Attributes learnt on the way wait in ``attributes`` and go to the span in one call when
    the run ends (each SDK call takes a lock and cleans what it gets)."""

    span: Span
    server: Server
    context: Any  # the OpenTelemetry context with the span
    request_model: str | None = None
    terminal: Terminal | None = None
    error_type: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    ended: tuple[int, float] = (0, 0.0)  # when the run ended: time_ns, monotonic


_current: ContextVar[_Traced | None] = ContextVar("chatstream_traced_attempt", default=None)


class Tracing(NoTracing):
    """Spans and GenAI metrics through the OpenTelemetry API (the global providers unless
    given)."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ) -> None:
        from opentelemetry import metrics as otel_metrics
        from opentelemetry import trace

        self._settings = settings
        self._labels = metrics
        self._servers: dict[str, Server] = {}
        self._attribute_sets: dict[tuple[Any, ...], Any] = {}
        self._ending: list[tuple[_Traced, JobTiming, Outcome | None]] = []
        self._flush_at: asyncio.TimerHandle | None = None
        # exemplars (a metric point naming a span) only when the operator picks a filter:
        # each costs about a third of a record, and the span's attributes hold the same
        self._exemplars = bool(os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER"))
        version = package_version()
        self._tracer = trace.get_tracer(
            "chatstream", version, tracer_provider, schema_url=telemetry.SCHEMA_URL
        )
        meter = otel_metrics.get_meter(
            "chatstream", version, meter_provider, schema_url=telemetry.SCHEMA_URL
        )
        self._tokens = meter.create_histogram(
            "gen_ai.client.token.usage",
            "{token}",
            "Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )
        self._duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            "s",
            "GenAI operation duration.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._first_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time to receive the first chunk.",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )

    async def run(self, job: Attempt, started: Started, work: Work) -> Outcome:
        from opentelemetry import context, trace

        server = self.server(job.upstream)
        parent = telemetry.job_context(started.trace_context)
        span = self._tracer.start_span(
            OPERATION,
            parent,
            trace.SpanKind.CLIENT,
            _start_attributes(job, started, server),
        )
        in_span = trace.set_span_in_context(span, parent)
        traced = _Traced(span, server, in_span)
        token = context.attach(in_span)
        mine = _current.set(traced)
        try:
            outcome = await work()
        except BaseException as exc:
            _failed(traced, exc)
            self._end(traced, job.timing, None)
            raise
        finally:
            _current.reset(mine)
            context.detach(token)
        self._end(traced, job.timing, outcome)
        return outcome

    def _end(self, traced: _Traced, timing: JobTiming, outcome: Outcome | None) -> None:
        """The run is over: its span ends (at this time) and its metrics are recorded with
        the others that end within ``END_BATCH_SECONDS`` (decision 63)."""
        traced.ended = (time.time_ns(), time.monotonic())
        self._ending.append((traced, timing, outcome))
        if self._flush_at is None:
            loop = asyncio.get_running_loop()
            self._flush_at = loop.call_later(END_BATCH_SECONDS, self.flush)

    def flush(self) -> None:
        """End the spans of the runs that ended since the last flush and record their
        metrics (also called at shutdown, before the exporters' last export)."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        ending, self._ending = self._ending, []
        for traced, timing, outcome in ending:
            measured = outcome is not None and self._finished(traced, timing, outcome)
            traced.span.set_attributes(traced.attributes)
            traced.span.end(traced.ended[0])
            if measured:  # without an exemplar unless asked for (decision 63)
                self._record(traced, timing, traced.context if self._exemplars else None)

    def server(self, upstream: str) -> Server:
        """The upstream's provider and address (an unknown name: the provider ``openai``)."""
        if upstream not in self._servers:
            try:
                target = self._settings.upstream(upstream)
            except UnknownUpstreamError:
                return Server("openai")
            url = urlsplit(target.completions_url)
            port = url.port or (443 if url.scheme == "https" else 80)
            self._servers[upstream] = Server(target.provider, url.hostname, port)
        return self._servers[upstream]

    def requested(self, body: dict[str, Any]) -> None:
        traced = _current.get()
        if traced is None:
            return
        model = body.get("model")
        if isinstance(model, str):
            traced.request_model = model
            traced.span.update_name(f"{OPERATION} {model}")
            traced.attributes["gen_ai.request.model"] = model
        traced.attributes.update(request_attributes(body))

    def routed(self, route: str, upstream: str) -> None:
        traced = _current.get()
        if traced is None:
            return
        traced.server = self.server(upstream)
        traced.attributes.update(traced.server.attributes())
        traced.attributes["gen_ai.system"] = traced.server.provider
        traced.attributes["chatstream.upstream"] = upstream
        traced.attributes["chatstream.route"] = route

    def retried(self, stage: str, exc: BaseException, wait: float | None = None) -> None:
        traced = _current.get()
        if traced is None:
            return
        attributes: dict[str, Any] = {"chatstream.retry.stage": stage, "error.type": _code(exc)}
        if wait is not None:
            attributes["chatstream.retry.wait_seconds"] = round(wait, 6)
        traced.span.add_event("chatstream.retry", attributes)

    def reset(self, attempt: int) -> None:
        traced = _current.get()
        if traced is None:
            return
        traced.span.add_event("chatstream.reset", {"chatstream.job.attempt": attempt})
        traced.attributes["chatstream.job.attempt"] = attempt

    def ending(self, terminal: Terminal) -> None:
        traced = _current.get()
        if traced is None:
            return
        traced.terminal = terminal
        link = telemetry.traceparent(traced.span)
        if link is not None:
            terminal.event_data["traceparent"] = link  # a consumer links its span to ours

    # -- the end of the attempt ---------------------------------------------------------

    def _finished(self, traced: _Traced, timing: JobTiming, outcome: Outcome) -> bool:
        """The span's attributes, events and status of a run that returned; whether it has
        the GenAI metrics (it wrote a terminal state)."""
        span, terminal, attributes = traced.span, traced.terminal, traced.attributes
        _timing_attributes(traced, timing)
        if outcome.value != "finished" or terminal is None:
            attributes["chatstream.job.status"] = outcome.value  # stale | released
            if outcome.value == "released":
                span.add_event("chatstream.released", timestamp=traced.ended[0])
            return False
        status = terminal.fields["status"]
        attributes.update(response_attributes(terminal))
        if status == "cancelled":
            span.add_event("chatstream.cancelled", timestamp=traced.ended[0])
        error = terminal.event_data.get("error") if status == "failed" else None
        if isinstance(error, dict):
            traced.error_type = str(error.get("code", "error"))
            _mark_error(traced, traced.error_type, str(error.get("message", "")))
        return True

    def _record(self, traced: _Traced, timing: JobTiming, where: Any) -> None:
        """The GenAI client metrics of an attempt that wrote its terminal state; ``where``:
        the context whose span an exemplar names (None: the current one)."""
        terminal = traced.terminal
        assert terminal is not None
        response_model = terminal.fields.get("model") or None
        tokens, operation = self._metric_attributes(
            traced.server, traced.request_model, response_model, traced.error_type
        )
        usage = terminal.event_data.get("usage")
        if isinstance(usage, dict):
            for kind, key in (("input", "prompt_tokens"), ("output", "completion_tokens")):
                count = usage.get(key)
                if _is_count(count):
                    self._tokens.record(count, tokens[kind], where)
        if timing.first_read is not None:
            self._first_chunk.record(timing.first_read - timing.started, operation, where)
        if terminal.fields["status"] != "cancelled":
            self._duration.record(traced.ended[1] - timing.started, operation, where)

    def _metric_attributes(
        self, server: Server, request: str | None, response: str | None, error_type: str | None
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """The metric attributes of an attempt: per token type, and of its operation; kept
        per (server, models, error), as most attempts share them (the SDK copies them)."""
        key = (server, request, response, error_type)
        found = self._attribute_sets.get(key)
        if found is None:
            base = {"gen_ai.operation.name": OPERATION, **server.attributes()}
            if request is not None:
                base["gen_ai.request.model"] = self._labels.model_label(request)
            if response is not None:
                base["gen_ai.response.model"] = self._labels.model_label(response)
            tokens = {kind: {**base, "gen_ai.token.type": kind} for kind in ("input", "output")}
            operation = base if error_type is None else {**base, "error.type": error_type}
            if len(self._attribute_sets) >= MAX_ATTRIBUTE_SETS:
                self._attribute_sets.clear()
            found = self._attribute_sets[key] = (tokens, operation)
        return found


def tracing_for_process(settings: Settings, metrics: Metrics) -> NoTracing:
    """:class:`Tracing` when this process traces (``telemetry.tracing_on``), else the
    hooks that do nothing."""
    return Tracing(settings, metrics) if telemetry.tracing_on() else NoTracing()


def _start_attributes(job: Attempt, started: Started, server: Server) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": OPERATION,
        "gen_ai.system": server.provider,  # the name before v1.37, for older backends
        **server.attributes(),
        "chatstream.job.id": job.job_id,
        "chatstream.job.attempt": job.attempt,
        "chatstream.upstream": job.upstream,
    }
    if started.created_at is not None:
        queued = max(time.time() - started.created_at, 0.0)
        attributes["chatstream.job.queued_seconds"] = round(queued, 6)
    return attributes


def request_attributes(body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling parameters (numbers) and choice count, never its text."""
    found: dict[str, Any] = {}
    for name, attribute in REQUEST_ATTRIBUTES.items():
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            found.setdefault(attribute, value)
    choices = body.get("n")
    if type(choices) is int and choices != 1:
        found["gen_ai.request.choice.count"] = choices
    return found


def response_attributes(terminal: Terminal) -> dict[str, Any]:
    """What the upstream answered: ids, model, finish reasons, token usage, the status."""
    fields, data = terminal.fields, terminal.event_data
    found: dict[str, Any] = {"chatstream.job.status": fields["status"]}
    if fields.get("completion_id"):
        found["gen_ai.response.id"] = fields["completion_id"]
    if fields.get("model"):
        found["gen_ai.response.model"] = fields["model"]
    reasons = [data.get("finish_reason")]
    reasons += [choice.get("finish_reason") for choice in data.get("choices") or ()]
    if any(isinstance(reason, str) for reason in reasons):
        found["gen_ai.response.finish_reasons"] = [r for r in reasons if isinstance(r, str)]
    usage = data.get("usage")
    if isinstance(usage, dict):
        for key, attribute in (
            ("prompt_tokens", "gen_ai.usage.input_tokens"),
            ("completion_tokens", "gen_ai.usage.output_tokens"),
        ):
            if _is_count(usage.get(key)):
                found[attribute] = usage[key]
    return found


def _timing_attributes(traced: _Traced, timing: JobTiming) -> None:
    """Time waiting for the upstream's first byte; the first token, as an event at its time."""
    if timing.first_read is not None:
        waited = round(timing.first_read - timing.started, 6)
        traced.attributes["chatstream.upstream.wait_seconds"] = waited
    if timing.first_delta is not None:
        ended_ns, ended = traced.ended
        stamp = ended_ns - int((ended - timing.first_delta) * 1e9)
        traced.span.add_event("chatstream.first_token", timestamp=stamp)


def _mark_error(traced: _Traced, code: str, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    traced.attributes["error.type"] = code
    traced.span.set_status(Status(StatusCode.ERROR, message[:MAX_STATUS_MESSAGE]))


def _failed(traced: _Traced, exc: BaseException) -> None:
    """The attempt raised (a bug, or the task was cancelled at shutdown)."""
    if isinstance(exc, asyncio.CancelledError):
        traced.attributes["chatstream.job.status"] = "interrupted"
        return
    traced.span.record_exception(exc)
    _mark_error(traced, type(exc).__qualname__, f"{type(exc).__name__}: {exc}")


def _code(exc: BaseException) -> str:
    return exc.code if isinstance(exc, ChatstreamError) else type(exc).__qualname__


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
