"""worker/telemetry.py: when OpenTelemetry is on, what it imports when it is off, the trace
context of a record, the ids of JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from tests.helpers.processes import clean_env
from worker import logs, telemetry
from worker.errors import ConfigError
from worker.settings import Settings

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}


def test_only_an_otlp_endpoint_asks_for_export_and_the_sdk_switch_wins() -> None:
    assert not telemetry.requested({})
    assert not telemetry.requested({"OTEL_SERVICE_NAME": "x"})
    assert telemetry.requested(ENDPOINT)
    assert telemetry.requested({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"})
    assert not telemetry.requested({**ENDPOINT, "OTEL_SDK_DISABLED": "TRUE"})
    assert telemetry.requested({**ENDPOINT, "OTEL_SDK_DISABLED": "false"})
    assert telemetry.setup("chatstream-test", {}) is None  # nothing asked: nothing installed


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "http/protobuf only"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "http/protobuf only"),
        ("OTEL_TRACES_EXPORTER", "zipkin", "exports otlp"),
    ],
)
def test_an_exporter_chatstream_does_not_offer_is_a_configuration_error(
    variable: str, value: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        telemetry.setup("chatstream-test", {**ENDPOINT, variable: value})


HOOKS = """
import sys
from redis.asyncio import Redis
from tests.helpers.processes import clean_env
from worker import logs, telemetry
from worker.service.worker import Worker
from worker.settings import Settings
import worker.client, worker.gateway.app, worker.upstream.client
assert telemetry.setup("chatstream-test") is None and not telemetry.tracing_on()
assert type(Worker(Settings(_env_file=None), Redis()).tracing).__name__ == "NoTracing"
assert telemetry.context_fields() == {} and telemetry.log_ids() == {}
headers = {}
telemetry.inject_upstream(headers, baggage=True)
assert headers == {}
logs.JsonFormatter().format(logs.logging.LogRecord("x", 20, "", 0, "m", None, None))
"""


def run_python(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_the_extra_every_hook_is_a_no_op() -> None:
    """opentelemetry not installed (its import blocked): the worker, the client and the
    gateway import, build and log as before."""
    run_python('import sys\nsys.modules["opentelemetry"] = None\n' + HOOKS)


def test_without_the_variables_the_sdk_and_exporters_are_never_imported() -> None:
    """The extra installed, no OTEL_* variables: no provider, no span, nothing sent; of
    OpenTelemetry only the API is loaded (redis-py loads it itself when it is installed)."""
    pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra")
    loaded = run_python(HOOKS + 'print(" ".join(m for m in sys.modules if "opentelemetry" in m))')
    assert "opentelemetry.exporter" not in loaded and "opentelemetry.sdk.trace" not in loaded


def test_a_record_stores_the_active_spans_context_and_its_baggage() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra")
    from opentelemetry import baggage, context
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    assert telemetry.context_fields() == {}  # no active span
    with tracer.start_as_current_span("outer") as span:
        token = context.attach(baggage.set_baggage("team", "search"))
        try:
            fields = telemetry.context_fields()
        finally:
            context.detach(token)
    ids = span.get_span_context()
    assert fields["traceparent"].split("-")[1:3] == [f"{ids.trace_id:032x}", f"{ids.span_id:016x}"]
    assert fields["baggage"] == "team=search" and "tracestate" not in fields
    restored = telemetry.job_context(fields)
    assert baggage.get_baggage("team", restored) == "search"


def test_json_log_lines_carry_the_active_spans_ids(settings: Settings) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra")
    from opentelemetry.sdk.trace import TracerProvider

    stream = io.StringIO()
    handler = logs.build_handler(settings.model_copy(update={"log_format": "json"}), stream)
    logger = logging.getLogger("chatstream.test.telemetry")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("outside")
        with TracerProvider().get_tracer("test").start_as_current_span("job") as span:
            logger.info("inside")
    finally:
        logger.removeHandler(handler)
    outside, inside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert "trace_id" not in outside and "span_id" not in outside
    ids = span.get_span_context()
    assert inside["trace_id"] == f"{ids.trace_id:032x}"
    assert inside["span_id"] == f"{ids.span_id:016x}"
