"""An OTLP/HTTP receiver for the tests: what a collector would get from chatstream's
processes, decoded with ``opentelemetry-proto`` (the ``otel`` extra brings it).

    async with receiving() as otlp:       # otlp.endpoint: OTEL_EXPORTER_OTLP_ENDPOINT
        ...                               # otlp.spans, otlp.histograms(name)
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.helpers.checks import eventually
from worker.embedded_server import EmbeddedServer, bind, served

Message = dict[str, Any]


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(value_of(item) for item in value.array_value.values)
    return None if kind is None else getattr(value, kind)


def attributes_of(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in pairs:
        assert isinstance(pair, KeyValue)
        found[pair.key] = value_of(pair.value)
    return found


@dataclass(frozen=True)
class Span:
    """A received span, decoded: ids as ints, attributes and events as dicts."""

    name: str
    kind: int  # 2 SERVER, 3 CLIENT (SpanKind of the proto)
    trace_id: int
    span_id: int
    parent_id: int | None
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any]


@dataclass(frozen=True)
class HistogramPoint:
    attributes: dict[str, Any]
    count: int
    sum: float
    resource: dict[str, Any]


@dataclass
class Receiver:
    """What arrived so far (every export request, decoded)."""

    endpoint: str = ""
    spans: list[Span] = field(default_factory=list)
    metric_requests: list[ExportMetricsServiceRequest] = field(default_factory=list)
    requests: int = 0

    async def until(self, check: Callable[[Receiver], bool], timeout: float = 10) -> None:
        """Wait until ``check(self)`` holds (TimeoutError after ``timeout`` seconds)."""

        async def holds() -> bool:
            return check(self)

        await eventually(holds, timeout)

    def histograms(self, name: str) -> list[HistogramPoint]:
        """The latest data point per attribute set (exports are cumulative) of ``name``."""
        latest: dict[tuple[Any, ...], HistogramPoint] = {}
        for request in self.metric_requests:
            for resource_metrics in request.resource_metrics:
                resource = attributes_of(resource_metrics.resource.attributes)
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        if metric.name != name:
                            continue
                        for point in metric.histogram.data_points:
                            attributes = attributes_of(point.attributes)
                            key = tuple(sorted(attributes.items()))
                            found = HistogramPoint(attributes, point.count, point.sum, resource)
                            latest[key] = found
        return list(latest.values())

    def take_spans(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                self.spans.extend(_span(span, resource) for span in scope.spans)

    def take_metrics(self, body: bytes) -> None:
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        self.metric_requests.append(request)


def _span(span: Any, resource: dict[str, Any]) -> Span:
    return Span(
        name=span.name,
        kind=span.kind,
        trace_id=int.from_bytes(span.trace_id, "big"),
        span_id=int.from_bytes(span.span_id, "big"),
        parent_id=int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None,
        attributes=attributes_of(span.attributes),
        events={event.name: attributes_of(event.attributes) for event in span.events},
        status_code=span.status.code,
        resource=resource,
    )


def _app(receiver: Receiver) -> Callable[..., Any]:
    handlers: dict[str, tuple[Callable[[bytes], None], bytes]] = {
        "/v1/traces": (receiver.take_spans, ExportTraceServiceResponse().SerializeToString()),
        "/v1/metrics": (
            receiver.take_metrics,
            ExportMetricsServiceResponse().SerializeToString(),
        ),
    }

    async def app(scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if (b"content-encoding", b"gzip") in scope["headers"]:
            body = gzip.decompress(body)
        receiver.requests += 1
        take, reply = handlers.get(scope["path"], (None, b""))
        status = 404 if take is None else 200
        if take is not None:
            take(body)
        headers = [(b"content-type", b"application/x-protobuf")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    return app


@asynccontextmanager
async def receiving() -> AsyncIterator[Receiver]:
    """An OTLP/HTTP receiver on a free loopback port, in this event loop."""
    receiver = Receiver()
    sock = bind("127.0.0.1", 0, what="the OTLP receiver")
    config = uvicorn.Config(_app(receiver), log_level="warning", access_log=False, lifespan="off")
    async with served(EmbeddedServer(config, name="otlp"), sock) as port:
        receiver.endpoint = f"http://127.0.0.1:{port}"
        yield receiver
