"""OpenTelemetry, when the ``otel`` extra is installed and the standard variables ask for it.

Shared by the client, the gateway and the worker: setting a process up to export over
OTLP (:func:`setup`), whether this process traces (:func:`tracing_on`), the W3C trace
context a job carries (:func:`context_fields` at enqueue, :func:`job_context` in the
worker), what goes upstream (:func:`inject_upstream`) and the ids of JSON log lines
(:func:`log_ids`). docs/operations.md ("Traces") says how to run it, docs/decisions.md
which semantic conventions it follows.

Nothing here imports opentelemetry until something in the process did: the calls on the
hot path look in ``sys.modules`` first, so without the extra they cost a dictionary
lookup. (With the extra installed, redis-py loads the API itself; then, without a span,
they find none and add nothing: a few microseconds per job.) The SDK and the exporters
are imported only by :func:`setup`, when the variables ask for export. An application
that set its own TracerProvider or MeterProvider keeps it: :func:`setup` only fills in
what is unset.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from worker.errors import ConfigError

log = logging.getLogger("chatstream.telemetry")

SCHEMA_URL = "https://opentelemetry.io/schemas/1.38.0"
"""The semantic conventions version chatstream's spans and metrics follow (decision 57)."""

TRACE_FIELDS = ("traceparent", "tracestate", "baggage")
"""The W3C trace context stored with a job: record fields of the same names as the headers."""

ENDPOINT_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
)
PROTOCOLS = ("http/protobuf",)
_API = "opentelemetry.trace"  # in sys.modules once anything in the process uses OpenTelemetry


def sdk_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``OTEL_SDK_DISABLED=true``: no telemetry at all, whatever else is set."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """The environment asks for export: an OTLP endpoint is set and the SDK not disabled."""
    return not sdk_disabled(environ) and any(environ.get(name) for name in ENDPOINT_VARIABLES)


def _wanted(signal: str, environ: Mapping[str, str]) -> bool:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``otlp`` (the default) or ``none``."""
    exporter = environ.get(f"OTEL_{signal.upper()}_EXPORTER", "otlp").strip().lower()
    if exporter not in ("otlp", "none"):
        raise ConfigError(f"OTEL_{signal.upper()}_EXPORTER={exporter}: chatstream exports otlp")
    return exporter == "otlp"


def _check_protocol(environ: Mapping[str, str]) -> None:
    for name in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        protocol = environ.get(name, "http/protobuf").strip().lower()
        if protocol not in PROTOCOLS:
            raise ConfigError(f"{name}={protocol}: chatstream exports http/protobuf only")


@dataclass
class Exporting:
    """The providers :func:`setup` installed; :meth:`shutdown` exports what is left."""

    providers: list[Any]

    def shutdown(self) -> None:
        for provider in self.providers:
            try:
                provider.shutdown()
            except Exception as exc:  # a collector that is gone must not fail the exit
                log.warning("OpenTelemetry: exporting the last data failed: %s", exc)


def setup(service_name: str, environ: Mapping[str, str] = os.environ) -> Exporting | None:
    """At a process's start (worker, gateway): a TracerProvider and a MeterProvider that
    export over OTLP/HTTP, where the environment asks for it and no provider is set yet.

    None when it does not ask, or the extra is missing (said in a WARNING line); raises
    ConfigError for a protocol or exporter chatstream does not offer.
    """
    if not requested(environ):
        return None
    _check_protocol(environ)
    traces, meters = _wanted("traces", environ), _wanted("metrics", environ)
    try:
        from worker import telemetry_sdk
    except ImportError as exc:
        log.warning(
            "OpenTelemetry is configured (%s) but not installed (%s): pip install "
            "'chatstream[otel]'",
            ", ".join(name for name in ENDPOINT_VARIABLES if environ.get(name)),
            exc,
        )
        return None
    return Exporting(telemetry_sdk.install(service_name, traces=traces, meters=meters))


def tracing_on() -> bool:
    """This process traces: a TracerProvider is set (by :func:`setup` or the application)
    and the SDK is not disabled. Asked once, when a worker or gateway is built."""
    if sdk_disabled() or _API not in sys.modules:
        return False
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def context_fields() -> dict[str, str]:
    """The W3C trace context of the active span (and its baggage), as record fields; empty
    without an active span. ``Client.enqueue`` stores it with the job."""
    if _API not in sys.modules or sdk_disabled():
        return {}
    trace_context, baggage = _propagators()
    carrier: dict[str, str] = {}
    trace_context.inject(carrier)
    if carrier:
        baggage.inject(carrier)
    return {name: carrier[name] for name in TRACE_FIELDS if carrier.get(name)}


def job_context(carrier: Mapping[str, str]) -> Any:
    """The OpenTelemetry context of a stored trace context (an empty one without it)."""
    trace_context, baggage = _propagators()
    context = trace_context.extract(carrier)
    return baggage.extract(carrier, context) if "baggage" in carrier else context


def inject_upstream(headers: MutableMapping[str, str], *, baggage: bool = False) -> None:
    """Add the active span's ``traceparent`` (and ``tracestate``) to an upstream request;
    the W3C ``baggage`` only when the upstream's ``forward_baggage`` opts in."""
    if _API not in sys.modules:
        return
    trace_context, baggage_propagator = _propagators()
    trace_context.inject(headers)
    if baggage and "traceparent" in headers:
        baggage_propagator.inject(headers)


def traceparent(span: Any) -> str | None:
    """A span's W3C ``traceparent`` (None for an invalid one), for a consumer to link its
    own span to."""
    context = span.get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


@functools.cache
def _propagators() -> tuple[Any, Any]:
    """The W3C trace context and baggage propagators (themselves, not the global one:
    decision 57)."""
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator(), W3CBaggagePropagator()


def log_ids() -> dict[str, str]:
    """``trace_id`` and ``span_id`` (hex) of the active span, for a JSON log line."""
    if _API not in sys.modules:
        return {}
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}
