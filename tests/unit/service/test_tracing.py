"""The worker's OpenTelemetry in one process: the attempt's span, its parent (the
enqueueing span), what the upstream and the terminal entry carry, the GenAI metrics.

The SDK's in-memory exporter and reader stand in for a collector (tests/system/test_otel.py
runs real processes against an OTLP receiver); the providers are the test's own, never the
process's global ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra: pip install -e '.[otel]'")

from opentelemetry import baggage, context, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from redis.asyncio import Redis

from tests.helpers.harness import MOCK, chat
from worker.client import Client
from worker.service.metrics import Metrics
from worker.service.tracing import END_BATCH_SECONDS, Tracing
from worker.service.worker import Worker
from worker.settings import Route, RouteTarget, Settings, Upstream
from worker.testing.mock_upstream import MockUpstream, expected_usage

SECRET_TEXT = "the-prompt-text-nobody-may-see"


@dataclass
class Traced:
    worker: Worker
    client: Client
    mock: MockUpstream
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer: trace.Tracer

    def attempt_spans(self) -> list[ReadableSpan]:
        self.worker.tracing.flush()  # the spans of runs that ended (they end in batches)
        return [s for s in self.spans.get_finished_spans() if s.kind is SpanKind.CLIENT]

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        self.worker.tracing.flush()
        data = self.metrics.get_metrics_data()
        assert data is not None
        return [
            (dict(point.attributes or {}), point)
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]


@pytest.fixture
def providers() -> Iterator[tuple[TracerProvider, InMemorySpanExporter, MeterProvider, Any]]:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    yield tracer_provider, spans, meter_provider, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
async def traced(
    settings: Settings,
    redis: Redis,
    mock_upstream: tuple[MockUpstream, str],
    providers: tuple[TracerProvider, InMemorySpanExporter, MeterProvider, Any],
) -> AsyncIterator[Traced]:
    mock, url = mock_upstream
    tracer_provider, spans, meter_provider, reader = providers
    upstreams = {
        "default": Upstream(url=url, provider="groq"),
        "inner": Upstream(url=url, forward_baggage=True),
    }
    routes = {"fast": Route(targets=[RouteTarget(upstream="default", model="routed-model")])}
    settings = settings.model_copy(update={"upstreams": upstreams, "routes": routes})
    tracing = Tracing(settings, Metrics(), tracer_provider, meter_provider)
    worker = Worker(settings, redis, tracing=tracing)
    await worker.startup()
    client = Client.from_settings(settings, redis)
    tracer = tracer_provider.get_tracer("the-backend")
    yield Traced(worker, client, mock, spans, reader, tracer)
    await worker.shutdown()


async def enqueue_in_span(t: Traced, request: dict[str, Any], **kwargs: Any) -> tuple[str, Any]:
    """Enqueue inside the backend's own span (with baggage); that span's context."""
    with t.tracer.start_as_current_span("backend request") as span:
        token = context.attach(baggage.set_baggage("tenant", "internal-42"))
        try:
            job_id = await t.client.enqueue(request, **kwargs)
        finally:
            context.detach(token)
    return job_id, span.get_span_context()


def ids(traceparent: str) -> tuple[int, int]:
    """(trace id, parent span id) of a W3C traceparent ``00-<trace>-<span>-<flags>``."""
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return int(trace_id, 16), int(span_id, 16)


def all_attribute_values(spans: list[ReadableSpan]) -> list[str]:
    values = [str(v) for s in spans for v in (s.attributes or {}).values()]
    values += [str(v) for s in spans for e in s.events for v in (e.attributes or {}).values()]
    return values


async def test_a_succeeded_job_is_one_span_in_the_callers_trace(traced: Traced) -> None:
    request = chat(SECRET_TEXT)
    job_id, parent = await enqueue_in_span(traced, request)
    record = await traced.client.records.fetch(job_id)
    assert ids(record["traceparent"]) == (parent.trace_id, parent.span_id)
    assert record["baggage"] == "tenant=internal-42"
    assert await traced.worker.run_burst() == 1

    [span] = traced.attempt_spans()
    assert span.name == "chat mock-model"
    assert span.context.trace_id == parent.trace_id
    assert span.parent is not None and span.parent.span_id == parent.span_id
    attributes = dict(span.attributes or {})
    usage = expected_usage(request, MOCK)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == attributes["gen_ai.system"] == "groq"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"]
    assert str(attributes["gen_ai.response.id"]).startswith("chatcmpl-mock")
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["server.address"] == "127.0.0.1"
    assert isinstance(attributes["server.port"], int)
    assert attributes["chatstream.job.id"] == job_id
    assert attributes["chatstream.job.attempt"] == 1
    assert attributes["chatstream.upstream"] == "default"
    assert attributes["chatstream.job.status"] == "succeeded"
    assert 0 <= float(str(attributes["chatstream.job.queued_seconds"])) < 10
    assert 0 < float(str(attributes["chatstream.upstream.wait_seconds"])) < 5
    assert "error.type" not in attributes and span.status.status_code is StatusCode.UNSET
    [first_token] = [e for e in span.events if e.name == "chatstream.first_token"]
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time < first_token.timestamp < span.end_time
    assert not [v for v in all_attribute_values([span]) if SECRET_TEXT in v or "tok1" in v]

    own = (parent.trace_id, span.context.span_id)
    headers = traced.mock.request_headers[-1]
    assert ids(headers["traceparent"]) == own  # the upstream's request: a child of our span
    assert "baggage" not in headers  # never the caller's baggage, unless the upstream opts in
    events = [event async for event in traced.client.events(job_id)]
    assert events[-1].type == "done" and ids(events[-1].data["traceparent"]) == own


async def test_a_routed_jobs_span_names_its_target(traced: Traced) -> None:
    job_id = await traced.client.enqueue({**chat("hi"), "model": "fast"})
    assert await traced.worker.run_burst() == 1
    [span] = traced.attempt_spans()
    attributes = dict(span.attributes or {})
    assert span.name == "chat routed-model"
    assert attributes["gen_ai.request.model"] == "routed-model"
    assert (attributes["chatstream.route"], attributes["chatstream.upstream"]) == (
        "fast",
        "default",
    )
    assert attributes["gen_ai.provider.name"] == "groq"
    assert attributes["server.address"] == "127.0.0.1"
    assert (await traced.client.get(job_id)).served_model == "routed-model"


async def test_the_metrics_of_a_succeeded_and_a_failed_job(traced: Traced) -> None:
    ok, _ = await enqueue_in_span(traced, chat("hello there"))
    failed, _ = await enqueue_in_span(traced, chat("no", fault="http_400"))
    assert await traced.worker.run_burst() == 2
    spans = {s.attributes["chatstream.job.id"]: s for s in traced.attempt_spans() if s.attributes}
    bad = spans[failed]
    assert bad.status.status_code is StatusCode.ERROR
    assert bad.attributes is not None and bad.attributes["error.type"] == "upstream_terminal"
    assert bad.attributes["chatstream.job.status"] == "failed"

    durations = traced.points("gen_ai.client.operation.duration")
    by_error = {attrs.get("error.type"): point for attrs, point in durations}
    assert set(by_error) == {None, "upstream_terminal"}
    assert by_error[None].count == by_error["upstream_terminal"].count == 1
    for attributes, _ in durations:
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "groq"
        assert attributes["gen_ai.request.model"] == "mock-model"
    tokens = {
        attrs["gen_ai.token.type"]: p for attrs, p in traced.points("gen_ai.client.token.usage")
    }
    usage = expected_usage(chat("hello there"), MOCK)
    assert tokens["input"].sum == usage["prompt_tokens"] and tokens["input"].count == 1
    assert tokens["output"].sum == usage["completion_tokens"]
    [(ttfc_attributes, ttfc)] = traced.points("gen_ai.client.operation.time_to_first_chunk")
    assert ttfc.count == 1 and 0 < ttfc.sum < 5 and "error.type" not in ttfc_attributes
    assert ok in spans


async def test_retries_are_span_events(traced: Traced) -> None:
    await enqueue_in_span(traced, chat("x", fault="http_503", fail_times=1, key="r"))
    assert await traced.worker.run_burst() == 1
    [span] = traced.attempt_spans()
    [retry] = [e for e in span.events if e.name == "chatstream.retry"]
    assert retry.attributes is not None
    assert retry.attributes["chatstream.retry.stage"] == "upstream"
    assert retry.attributes["error.type"] == "upstream_retryable"
    assert span.attributes is not None and span.attributes["chatstream.job.status"] == "succeeded"


async def test_spans_end_in_batches_at_their_runs_end(traced: Traced) -> None:
    """A run's span ends (and its metrics are recorded) with the others that end within
    END_BATCH_SECONDS, stamped with the time its run ended."""
    job_ids = [await traced.client.enqueue(chat("x", key=str(n))) for n in range(3)]
    assert await traced.worker.run_burst(block_ms=0) == 3
    ended = time.time_ns()  # the spans, ended later, carry the times their runs ended
    await asyncio.sleep(END_BATCH_SECONDS * 2)
    spans = [s for s in traced.spans.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert sorted(str((s.attributes or {})["chatstream.job.id"]) for s in spans) == sorted(job_ids)
    for span in spans:
        assert span.end_time is not None and span.end_time <= ended
        [first] = [e for e in span.events if e.name == "chatstream.first_token"]
        assert span.start_time is not None and span.start_time < first.timestamp < span.end_time
    [(_, durations)] = traced.points("gen_ai.client.operation.duration")
    assert durations.count == 3


async def test_an_upstream_that_opts_in_gets_the_baggage(traced: Traced) -> None:
    await enqueue_in_span(traced, chat("x"), upstream="inner")
    assert await traced.worker.run_burst() == 1
    headers = traced.mock.request_headers[-1]
    assert headers["baggage"] == "tenant=internal-42" and "traceparent" in headers


async def test_a_job_enqueued_outside_any_span_starts_its_own_trace(traced: Traced) -> None:
    job_id = await traced.client.enqueue(chat("x"))
    assert "traceparent" not in await traced.client.records.fetch(job_id)
    assert await traced.worker.run_burst() == 1
    [span] = traced.attempt_spans()
    assert span.parent is None
    sent = ids(traced.mock.request_headers[-1]["traceparent"])
    assert sent == (span.context.trace_id, span.context.span_id)


async def test_without_tracing_nothing_is_stored_or_sent(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """The process has no TracerProvider: the worker's hooks do nothing (a span of the
    caller is still stored with the job, for a worker that traces)."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    worker = Worker(settings, redis)
    assert type(worker.tracing).__name__ == "NoTracing"
    client = Client.from_settings(settings, redis)
    job_id = await client.enqueue(chat("x"))
    await worker.startup()
    try:
        assert await worker.run_burst() == 1
    finally:
        await worker.shutdown()
    assert "traceparent" not in mock.request_headers[-1]
    events = [event async for event in client.events(job_id)]
    assert "traceparent" not in events[-1].data
