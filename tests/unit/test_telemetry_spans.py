"""worker.telemetry_spans writes the request the SDK's OTLP encoder builds, byte for byte
as ``opentelemetry-proto`` reads it: spans of every shape (attributes of every type the
SDK takes, events, links, status, remote and local parents, trace state), several
resources and scopes, attributes the SDK cannot encode; and the exporter that sends them
reaches a real OTLP/HTTP receiver."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra: pip install -e '.[otel]'")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry import context, trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import TraceState

from tests.helpers.otlp import receiving
from worker import internals
from worker.telemetry_sdk import SpanExporter
from worker.telemetry_spans import CACHE_LIMIT, SpanEncoder

INT64 = 1 << 63
keys = st.text(min_size=1, max_size=12)
scalars = st.one_of(
    st.text(max_size=20),
    st.booleans(),
    st.integers(-INT64, INT64 - 1),
    st.floats(allow_nan=False),
    st.binary(max_size=8),
)
values = st.one_of(
    scalars,
    st.lists(st.text(max_size=5), max_size=3).map(tuple),
    st.lists(st.integers(-INT64, INT64 - 1), max_size=3).map(tuple),
    st.lists(st.booleans(), max_size=3).map(tuple),
    st.lists(st.floats(allow_nan=False), max_size=3).map(tuple),
)
attributes = st.dictionaries(keys, values, max_size=6)
ids = st.integers(1, (1 << 64) - 1)
contexts = st.builds(
    lambda trace_id, span_id, remote, sampled, state: SpanContext(
        trace_id, span_id, remote, TraceFlags(int(sampled)), TraceState(state)
    ),
    st.integers(1, (1 << 128) - 1),
    ids,
    st.booleans(),
    st.booleans(),
    st.lists(
        st.tuples(st.sampled_from(["a", "vendor"]), st.sampled_from(["1", "x2"])),
        max_size=2,
        unique_by=lambda kv: kv[0],
    ),
)
statuses = st.one_of(
    st.just(None),
    st.builds(Status, st.sampled_from([StatusCode.OK, StatusCode.UNSET])),
    st.builds(Status, st.just(StatusCode.ERROR), st.text(max_size=20)),
)


@st.composite
def span_plans(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "name": draw(st.text(max_size=20)),
        "kind": draw(st.sampled_from(list(SpanKind))),
        "parent": draw(st.one_of(st.none(), contexts)),
        "attributes": draw(attributes),
        "set_later": draw(attributes),
        "events": draw(st.lists(st.tuples(st.text(max_size=8), attributes), max_size=3)),
        "links": draw(st.lists(st.tuples(contexts, attributes), max_size=2)),
        "status": draw(statuses),
        "provider": draw(st.integers(0, 1)),
        "scope": draw(
            st.sampled_from([("chatstream", "1.0", "https://x/1.38.0"), ("other", None, None)])
        ),
    }


class Providers:
    """Two TracerProviders with different resources, both keeping what they finish."""

    def __init__(self) -> None:
        self.kept = InMemorySpanExporter()
        self.providers = [
            TracerProvider(resource=Resource({"service.name": "a", "n": 1})),
            TracerProvider(resource=Resource({"service.name": "b"}, "https://schema/b")),
        ]
        for provider in self.providers:
            provider.add_span_processor(SimpleSpanProcessor(self.kept))

    def make(self, plan: dict[str, Any]) -> None:
        name, version, schema = plan["scope"]
        tracer = self.providers[plan["provider"]].get_tracer(name, version, schema_url=schema)
        parent = plan["parent"]
        where = trace.set_span_in_context(trace.NonRecordingSpan(parent)) if parent else None
        span = tracer.start_span(
            plan["name"],
            where or context.Context(),
            plan["kind"],
            plan["attributes"],
            [Link(linked, found) for linked, found in plan["links"]],
        )
        span.set_attributes(plan["set_later"])
        for event, found in plan["events"]:
            span.add_event(event, found)
        if plan["status"] is not None:
            span.set_status(plan["status"])
        span.end()

    def spans(self) -> list[ReadableSpan]:
        return list(self.kept.get_finished_spans())


def plain_plan(**changes: Any) -> dict[str, Any]:
    """A client span without parent, events or links, changed by ``changes``."""
    plan = {"name": "s", "kind": SpanKind.CLIENT, "parent": None, "attributes": {},
            "set_later": {}, "events": [], "links": [], "status": None, "provider": 0,
            "scope": ("chatstream", "1", None)}  # fmt: skip
    return plan | changes


def decoded(data: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(span_plans(), max_size=6))
def test_every_span_encodes_to_the_sdks_request(plans: list[dict[str, Any]]) -> None:
    made = Providers()
    for plan in plans:
        made.make(plan)
    spans = made.spans()
    encoder = SpanEncoder()
    assert decoded(encoder.request(spans)) == encode_spans(spans)
    assert decoded(encoder.request(spans)) == encode_spans(spans)  # again, from the cache


def test_an_attribute_the_sdk_cannot_encode_is_left_out_as_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    made = Providers()
    made.make(plain_plan(attributes={"big": 1 << 70, "ok": 1}))
    spans = made.spans()
    with caplog.at_level(logging.ERROR):
        ours = decoded(SpanEncoder().request(spans))
    assert ours == encode_spans(spans)
    assert [pair.key for pair in ours.resource_spans[0].scope_spans[0].spans[0].attributes] == [
        "ok"
    ]
    assert "big left out of the span" in caplog.text


def test_the_cache_is_bounded_and_stays_right() -> None:
    made = Providers()
    for n in range(3):
        many = {f"k{i}": f"{n}-{i}" for i in range(CACHE_LIMIT // 2)}
        made.make(plain_plan(attributes=many))
    spans, encoder = made.spans(), SpanEncoder()
    for _ in range(2):
        assert decoded(encoder.request(spans)) == encode_spans(spans)
        assert len(encoder._cache) <= CACHE_LIMIT


def test_the_empty_request() -> None:
    assert SpanEncoder().request([]) == b""
    assert decoded(b"") == encode_spans([])


async def test_the_exporter_sends_its_encoding_to_a_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Providers()
    found = {"gen_ai.operation.name": "chat", "server.port": 443}
    made.make(plain_plan(name="chat gpt", attributes=found, status=Status(StatusCode.ERROR, "x")))
    async with receiving() as otlp:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.endpoint)
        exporter = SpanExporter()
        # our encoding on the SDKs that have the client (test_internals holds which), else theirs
        assert exporter.encodes is internals.available("otel-exporter-client")
        result = await asyncio.to_thread(exporter.export, made.spans())
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, untyped
    assert result is SpanExportResult.SUCCESS
    (span,) = otlp.spans
    assert (span.name, span.kind, span.status_code) == ("chat gpt", 3, 2)
    assert span.attributes == {"gen_ai.operation.name": "chat", "server.port": 443}
    assert span.resource == {"service.name": "a", "n": 1}


async def test_without_the_sdks_http_client_the_exporter_is_the_sdks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SDK release whose exporter has no ``_client``: every export is the SDK's own."""
    made = Providers()
    made.make(plain_plan(name="chat m", attributes={"gen_ai.operation.name": "chat"}))
    async with receiving() as otlp:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.endpoint)
        exporter = SpanExporter()
        exporter.encodes = False
        monkeypatch.setattr(SpanEncoder, "request", _must_not_encode)
        result = await asyncio.to_thread(exporter.export, made.spans())
        exporter.shutdown()  # type: ignore[no-untyped-call]  # the SDK's, untyped
    assert result is SpanExportResult.SUCCESS
    assert [(s.name, s.attributes) for s in otlp.spans] == [
        ("chat m", {"gen_ai.operation.name": "chat"})
    ]


def _must_not_encode(self: SpanEncoder, spans: Any) -> bytes:
    raise AssertionError("chatstream's encoder was used")


def test_a_batch_that_fails_to_encode_is_dropped_with_a_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    made = Providers()
    made.make(plain_plan())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    exporter = SpanExporter()
    if not exporter.encodes:
        pytest.skip("this SDK's exporter has no client to hand our encoding to")
    monkeypatch.setattr(SpanEncoder, "request", _fails_to_encode)
    with caplog.at_level(logging.ERROR):
        assert exporter.export(made.spans()) is SpanExportResult.FAILURE
    assert "encoding 1 spans failed" in caplog.text


def _fails_to_encode(self: SpanEncoder, spans: Any) -> bytes:
    raise ValueError("a span nobody can encode")
