"""The OpenTelemetry SDK's providers and OTLP/HTTP exporters, installed by
:func:`worker.telemetry.setup` (imported only then: it needs the ``otel`` extra).

The exporters, the batch span processor and the periodic metric reader read the standard
variables themselves (``OTEL_EXPORTER_OTLP_*``, ``OTEL_BSP_*``,
``OTEL_METRIC_EXPORT_INTERVAL``); the resource reads ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, with chatstream's own service name when neither names one.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from worker import internals


def resource(service_name: str) -> Resource:
    """The environment's resource; ``service_name`` unless the environment names one."""
    found = Resource.create()
    if str(found.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        found = found.merge(Resource({SERVICE_NAME: service_name}))
    return found


def install(service_name: str, *, traces: bool, meters: bool) -> list[Any]:
    """Providers for what is not set yet (an application's own stay); returns those set."""
    installed: list[Any] = []
    where = resource(service_name)
    if traces and not _set(trace.get_tracer_provider()):
        tracer_provider = TracerProvider(resource=where)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
        installed.append(tracer_provider)
    if meters and not _set(metrics.get_meter_provider()):
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
        meter_provider = MeterProvider(resource=where, metric_readers=[reader])
        metrics.set_meter_provider(meter_provider)
        if metrics.get_meter_provider() is meter_provider:
            installed.append(meter_provider)
        else:  # one was set already (the API refused ours, and said so)
            meter_provider.shutdown()
    return installed


def _set(provider: object) -> bool:
    """A provider someone installed (not the API's stand-ins that wait for one)."""
    stand_ins = (
        trace.ProxyTracerProvider,
        trace.NoOpTracerProvider,
        metrics.NoOpMeterProvider,
    )
    if isinstance(provider, stand_ins):
        return False
    if not internals.available("otel-proxy-meter-provider"):
        return False  # offered anyway: install() keeps it only where the API takes it
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    return not isinstance(provider, _ProxyMeterProvider)
