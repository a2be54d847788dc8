"""OpenTelemetry end to end: ``chatstream worker`` and ``chatstream gateway`` processes
exporting over OTLP/HTTP to a receiver in the test (tests/helpers/otlp.py), configured by
the standard OTEL_* variables only.

One trace from the client's span through the gateway's span, the worker's span of the
attempt and the upstream's ``traceparent``; the GenAI attributes and metrics of a
succeeded and a failed job; nothing at all with ``OTEL_SDK_DISABLED=true``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("opentelemetry.proto", reason="needs the otel extra: pip install '.[otel]'")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.helpers.checks import until_serving
from tests.helpers.fleet import Fleet
from tests.helpers.gateway_env import KEY
from tests.helpers.harness import MOCK, chat
from tests.helpers.otlp import Receiver, Span, receiving
from tests.helpers.processes import CHATSTREAM
from tests.helpers.servers import free_port
from worker.testing.mock_upstream import expected_reply, expected_usage

SERVER, CLIENT, ERROR = 2, 3, 2  # the proto's SpanKind and StatusCode values
PROMPT = "a-prompt-that-must-stay-private"


def otel_env(otlp: Receiver, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=test",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        **more,
    }


def parent_of(traceparent: str) -> tuple[int, int]:
    _, trace_id, span_id, _ = traceparent.split("-")
    return int(trace_id, 16), int(span_id, 16)


def spawn_gateway(fleet: Fleet, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [CHATSTREAM, "gateway", "--host", "127.0.0.1", "--port", str(port)],
            env=fleet.env,
            cwd=fleet.directory,
            stderr=out,
        )


async def stop_gateway(gateway: subprocess.Popen[bytes]) -> None:
    gateway.send_signal(signal.SIGTERM)
    try:
        assert await asyncio.to_thread(gateway.wait, 15) == 0
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()


async def ask_gateway(port: int, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        await until_serving(http)
        auth = {"authorization": f"Bearer {KEY}", **headers}
        return await http.post("/v1/chat/completions", json=chat(PROMPT), headers=auth, timeout=20)


async def test_one_trace_from_the_client_through_gateway_worker_and_upstream(
    fleet: Fleet, tmp_path: Path
) -> None:
    client_tracer = TracerProvider().get_tracer("the-test-client")  # exports nowhere
    async with receiving() as otlp:
        fleet.configure(gateway_api_keys=KEY, log_format="json", log_level="DEBUG")
        fleet.env.update(otel_env(otlp))
        await fleet.start()
        port = free_port()
        gateway = spawn_gateway(fleet, port, tmp_path / "gateway.log")
        try:
            with client_tracer.start_as_current_span("client request") as client_span:
                headers: dict[str, str] = {}
                TraceContextTextMapPropagator().inject(headers)
                response = await ask_gateway(port, headers)
        finally:
            await stop_gateway(gateway)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected_reply(
            chat(PROMPT), MOCK
        )
        output = await fleet.stop()  # the last spans and metrics are exported on the way out
        await otlp.until(lambda got: any(s.kind == CLIENT for s in got.spans))
    trace_id = client_span.get_span_context().trace_id
    server = one(otlp.spans, SERVER, "POST /v1/chat/completions")
    attempt = one(otlp.spans, CLIENT, "chat mock-model")
    assert (server.trace_id, server.parent_id) == (trace_id, client_span.get_span_context().span_id)
    assert (attempt.trace_id, attempt.parent_id) == (trace_id, server.span_id)
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.resource["service.name"] == "chatstream-gateway"
    assert attempt.resource["service.name"] == "chatstream-worker"
    assert attempt.resource["deployment.environment.name"] == "test"
    upstream_parent = parent_of(fleet.mock.request_headers[-1]["traceparent"])
    assert upstream_parent == (trace_id, attempt.span_id)
    logged = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    job_lines = [line for line in logged if "trace_id" in line]
    assert job_lines and {line["trace_id"] for line in job_lines} == {f"{trace_id:032x}"}
    assert {line["span_id"] for line in job_lines} == {f"{attempt.span_id:016x}"}
    assert_no_text(otlp.spans)
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()


def one(spans: list[Span], kind: int, name: str) -> Span:
    found = [span for span in spans if span.kind == kind and span.name == name]
    assert len(found) == 1, [(s.kind, s.name) for s in spans]
    return found[0]


def assert_no_text(spans: list[Span]) -> None:
    """Neither the prompt nor a word of the reply is in any attribute or event."""
    values: list[Any] = [v for s in spans for v in s.attributes.values()]
    values += [v for s in spans for event in s.events.values() for v in event.values()]
    assert not [v for v in values if PROMPT in str(v) or "tok1" in str(v)]


async def test_attributes_and_metrics_of_a_succeeded_and_a_failed_job(fleet: Fleet) -> None:
    request = chat(PROMPT)
    failing = chat("fails", fault="http_400")
    async with receiving() as otlp:
        fleet.env.update(otel_env(otlp))
        await fleet.start()
        tracer = TracerProvider().get_tracer("a-backend")
        with tracer.start_as_current_span("backend work") as backend:
            ok = await fleet.client.enqueue(request)
            bad = await fleet.client.enqueue(failing)
        assert (await fleet.client.result(ok, timeout=20)).status == "succeeded"
        assert (await fleet.client.result(bad, timeout=20)).status == "failed"
        await fleet.stop()
        await otlp.until(lambda got: len([s for s in got.spans if s.kind == CLIENT]) == 2)
        await otlp.until(lambda got: bool(got.histograms("gen_ai.client.operation.duration")))
    spans = {s.attributes["chatstream.job.id"]: s for s in otlp.spans if s.kind == CLIENT}
    good, failed = spans[ok], spans[bad]
    assert {good.trace_id, failed.trace_id} == {backend.get_span_context().trace_id}
    usage = expected_usage(request, MOCK)
    assert good.name == "chat mock-model" and good.status_code == 0
    expected = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "mock-model",
        "gen_ai.response.model": "mock-model",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "server.address": "127.0.0.1",
        "chatstream.job.id": ok,
        "chatstream.job.attempt": 1,
        "chatstream.upstream": "default",
        "chatstream.job.status": "succeeded",
    }
    assert {k: good.attributes.get(k) for k in expected} == expected
    assert str(good.attributes["gen_ai.response.id"]).startswith("chatcmpl-mock")
    assert good.attributes["server.port"] == int(fleet.upstream_url.split(":")[2].split("/")[0])
    assert {"chatstream.job.queued_seconds", "chatstream.upstream.wait_seconds"} <= set(
        good.attributes
    )
    assert "chatstream.first_token" in good.events
    assert failed.status_code == ERROR and failed.attributes["error.type"] == "upstream_terminal"
    assert failed.attributes["chatstream.job.status"] == "failed"
    assert_no_text(otlp.spans)
    assert_metrics(otlp, usage)


def assert_metrics(otlp: Receiver, usage: dict[str, int]) -> None:
    durations = otlp.histograms("gen_ai.client.operation.duration")
    by_error = {point.attributes.get("error.type"): point for point in durations}
    assert set(by_error) == {None, "upstream_terminal"}
    assert by_error[None].count == by_error["upstream_terminal"].count == 1
    for point in durations:
        assert point.attributes["gen_ai.operation.name"] == "chat"
        assert point.attributes["gen_ai.provider.name"] == "openai"
        assert point.attributes["gen_ai.request.model"] == "mock-model"
    tokens = {
        p.attributes["gen_ai.token.type"]: p for p in otlp.histograms("gen_ai.client.token.usage")
    }
    assert (tokens["input"].count, tokens["input"].sum) == (1, usage["prompt_tokens"])
    assert (tokens["output"].count, tokens["output"].sum) == (1, usage["completion_tokens"])
    [first_chunk] = otlp.histograms("gen_ai.client.operation.time_to_first_chunk")
    assert first_chunk.count == 1 and 0 < first_chunk.sum < 10


async def test_nothing_is_exported_with_the_sdk_disabled(fleet: Fleet) -> None:
    async with receiving() as otlp:
        fleet.env.update(otel_env(otlp, OTEL_SDK_DISABLED="true"))
        await fleet.start()
        tracer = TracerProvider().get_tracer("a-backend")
        with tracer.start_as_current_span("backend work"):
            job_id = await fleet.client.enqueue(chat("x"))
        assert (await fleet.client.result(job_id, timeout=20)).status == "succeeded"
        await fleet.stop()
        await asyncio.sleep(1)  # two metric export intervals
    assert otlp.requests == 0
    assert "traceparent" not in fleet.mock.request_headers[-1]


async def test_a_collector_that_is_down_fails_no_job(fleet: Fleet) -> None:
    """docs/operations.md: spans and metrics are dropped, jobs are not; the worker still
    stops with exit 0 (its last export gives up after OTEL_EXPORTER_OTLP_TIMEOUT)."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    fleet.env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=down,
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_METRIC_EXPORT_INTERVAL="200",
    )
    await fleet.start()
    job_ids = [await fleet.client.enqueue(chat(f"x{n}")) for n in range(3)]
    for job_id in job_ids:
        record = await fleet.client.result(job_id, timeout=20)
        assert record.status == "succeeded"
        assert record.content == expected_reply(chat(f"x{job_ids.index(job_id)}"), MOCK)
    assert "traceparent" in fleet.mock.request_headers[-1]  # it traced all the same
    await asyncio.sleep(1)  # exports tried and failed meanwhile
    await fleet.stop(timeout=30)
