"""Log lines: text and JSON formats, job/attempt context, secrets never printed."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from tests.conftest import Harness, chat
from worker import logs
from worker.settings import Settings, Upstream

log = logging.getLogger("chatstream.test")


def json_settings(settings: Settings, **update: Any) -> Settings:
    return settings.model_copy(update={"log_format": "json", **update})


@pytest.fixture
def root_debug() -> Iterator[logging.Logger]:
    """The root logger at DEBUG for the test, restored afterwards."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    yield root
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def emit(handler: logging.Handler, message: str, *args: object, exc: bool = False) -> None:
    logger = logging.getLogger("chatstream.unit")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        if exc:
            logger.exception(message, *args)
        else:
            logger.warning(message, *args)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_json_lines_have_the_fields_and_the_bound_context(settings: Settings) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(json_settings(settings), stream)

    async def in_a_job() -> None:
        logs.bind(worker="w-1", job="job-42")
        logs.set_attempt(2)
        emit(handler, "inside %s", "the job")

    asyncio.run(in_a_job())
    emit(handler, "outside")  # the job's context stayed in its task
    inside, outside = lines(stream)
    assert inside["message"] == "inside the job"
    assert inside["level"] == "WARNING"
    assert inside["logger"] == "chatstream.unit"
    assert (inside["worker"], inside["job"], inside["attempt"]) == ("w-1", "job-42", 2)
    assert inside["ts"].endswith("+00:00")
    assert "job" not in outside and "attempt" not in outside


def test_json_lines_carry_the_traceback_as_a_string(settings: Settings) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(json_settings(settings), stream)
    try:
        raise ValueError("boom")
    except ValueError:
        emit(handler, "failed", exc=True)
    (line,) = lines(stream)
    assert line["message"] == "failed"
    assert "Traceback" in line["exc"] and "ValueError: boom" in line["exc"]


def test_text_lines_are_human_readable_with_job_tags(settings: Settings) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(settings, stream)

    async def in_a_job() -> None:
        logs.bind(job="abc")
        logs.set_attempt(1)
        emit(handler, "hello")

    asyncio.run(in_a_job())
    emit(handler, "plain")
    first, second = stream.getvalue().splitlines()
    assert first.endswith("WARNING chatstream.unit: hello [job=abc attempt=1]")
    assert second.endswith("WARNING chatstream.unit: plain")


def test_configured_secrets_are_masked_in_messages_and_tracebacks(settings: Settings) -> None:
    settings = json_settings(
        settings,
        upstream_api_key=SecretStr("sk-default-secret"),
        upstreams={
            "other": Upstream(
                url="https://other.example/v1",
                api_key=SecretStr("sk-other-secret"),
                headers={"Authorization": "Bearer hdr-secret-token"},
            )
        },
        redis_url="rediss://user:p%40ssw0rd@redis.example:6379/0?ssl_password=keyfile-pass",
    )
    stream = io.StringIO()
    handler = logs.build_handler(settings, stream)
    emit(handler, "key %s and %s", "sk-default-secret", "sk-other-secret")
    emit(handler, "url redis://user:p%40ssw0rd@host and p@ssw0rd and hdr-secret-token")
    emit(handler, "tls key keyfile-pass")
    emit(handler, "bad %s %s", "args")  # a broken call still reaches the handler
    try:
        raise RuntimeError("auth failed for sk-other-secret")
    except RuntimeError:
        emit(handler, "upstream error", exc=True)
    text = stream.getvalue()
    for secret in ("sk-default-secret", "sk-other-secret", "p%40ssw0rd", "p@ssw0rd", "hdr-secret"):
        assert secret not in text
    assert "keyfile-pass" not in text
    first, second, third, last = lines(stream)
    assert first["message"] == "key *** and ***"
    assert second["message"] == "url redis://user:***@host and *** and ***"
    assert third["message"] == "tls key ***"
    assert "RuntimeError: auth failed for ***" in last["exc"]


def test_configure_installs_one_handler_and_replaces_it(settings: Settings) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        logs.configure(settings, io.StringIO())
        stream = io.StringIO()
        handler = logs.configure(json_settings(settings, log_level="DEBUG"), stream)
        ours = [h for h in root.handlers if getattr(h, "chatstream", False)]
        assert ours == [handler]
        assert root.level == logging.DEBUG
        log.debug("to json")
        assert lines(stream)[-1]["message"] == "to json"
    finally:
        for h in [h for h in root.handlers if getattr(h, "chatstream", False)]:
            root.removeHandler(h)
        root.setLevel(level)


async def test_a_jobs_lines_carry_its_id_and_attempt(
    harness: Harness, root_debug: logging.Logger
) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(json_settings(harness.settings), stream)
    root_debug.addHandler(handler)
    try:
        request = chat("retry me", fault="http_500", fail_times=1, key="logs", retry_after=0)
        record = await harness.run(request)
        log.info("after the job")
    finally:
        root_debug.removeHandler(handler)
    assert record.status == "succeeded"
    ours = [line for line in lines(stream) if line["logger"].startswith("chatstream")]
    job_lines = [line for line in ours if line.get("job") == record.id]
    loggers = {line["logger"] for line in job_lines}
    assert {"chatstream.upstream", "chatstream.pipeline"} <= loggers  # the retry, the end
    assert all(line["attempt"] == 1 for line in job_lines)
    assert all(line["worker"] == harness.worker.name for line in job_lines)
    (after,) = [line for line in ours if line["message"] == "after the job"]
    assert "job" not in after
