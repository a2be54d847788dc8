"""Log lines: text and JSON formats, job/attempt context, secrets never printed."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from tests.helpers.harness import Harness, chat, custom_harness, inject
from tests.helpers.servers import free_port
from tests.unit.test_security import echo_server
from worker import logs, speedups
from worker.service.runtime import RuntimeChoices, runtime_choices
from worker.service.worker import Worker
from worker.settings import Settings, Upstream
from worker.speedups import chosen_transport
from worker.upstream import client as upstream_client

log = logging.getLogger("chatstream.test")

# redis-py picks hiredis when it is installed (the dev extras install it)
PARSER = "hiredis" if speedups.hiredis_installed() else "python"


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


async def start_up_line(
    configured: Settings, redis: Redis, root: logging.Logger, name: str
) -> tuple[dict[str, Any], io.StringIO]:
    """The JSON start-up line of a worker started and stopped with ``configured``, and all
    that worker logged."""
    stream = io.StringIO()
    handler = logs.build_handler(configured, stream)
    root.addHandler(handler)
    worker = Worker(configured, redis, name=name)
    try:
        await worker.startup()
        await worker.shutdown()
    finally:
        root.removeHandler(handler)
    [line] = [x for x in lines(stream) if " started: " in x["message"]]
    return line, stream


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


@pytest.mark.parametrize(
    ("secret", "message", "expected"),
    [
        ("x", "prefix=cs tenant=x", "prefix=cs tenant=***"),  # a word holding it: untouched
        ("x", "Bearer x", "Bearer ***"),
        ("x", "x", "***"),
        ("cs", "prefix=cs", "prefix=***"),  # the value itself, whole: masked
        (
            "s3cr3t",
            "xs3cr3t s3cr3tx s3cr3t_ s3cr3t-a s3cr3t.",
            "xs3cr3t s3cr3tx s3cr3t_ ***-a ***.",
        ),
        ("key=", "a key=b", "a ***b"),  # edges that are not letters or digits bind nothing
        ("p@ss", "redis://u:p@ss@h", "redis://u:***@h"),
    ],
)
def test_only_whole_credentials_are_masked(
    settings: Settings, secret: str, message: str, expected: str
) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(
        json_settings(settings, upstream_api_key=SecretStr(secret)), stream
    )
    emit(handler, message)
    assert lines(stream)[0]["message"] == expected


async def test_a_one_letter_key_leaves_the_start_up_line_readable(
    settings: Settings, redis: Redis, root_debug: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    http_logs = upstream_client._HTTP_LOG_REDACTION  # process-wide: keep "x" out of others
    monkeypatch.setattr(http_logs, "secrets", list(http_logs.secrets))
    configured = json_settings(
        settings,
        prefix="cs",
        upstream_url="https://mock.example/v1",
        upstream_api_key=SecretStr("x"),
    )
    line, _ = await start_up_line(configured, redis, root_debug, "w-short-key")
    assert "prefix=cs upstreams: default=https://mock.example/v1 " in line["message"]


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


# -- the failure line: one WARNING per job that ended failed --------------------------------


def failure_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in lines(stream) if line.get("event") == "job_failed"]


async def test_every_terminal_failure_is_one_warning_line(
    harness: Harness, root_debug: logging.Logger
) -> None:
    """401, retries exhausted, connection refused, a key echoed by the upstream, an invalid
    request, a record without a status, attempts exhausted: one WARNING line each, with
    job, attempt, upstream, code, HTTP status and the upstream's message; none for the
    jobs that did not fail."""
    echo_key = "sk-echo-" + uuid.uuid4().hex
    refused_port = free_port()
    async with echo_server() as echo_url:
        upstreams = {
            "echo": Upstream(url=echo_url, api_key=SecretStr(echo_key)),
            "closed": Upstream(url=f"http://127.0.0.1:{refused_port}/v1"),
        }
        async with custom_harness(harness, upstreams=upstreams, retry_attempts=2) as h:
            stream = io.StringIO()
            handler = logs.build_handler(json_settings(h.settings), stream)
            root_debug.addHandler(handler)
            try:
                jobs = await enqueue_failures(h)
                await h.worker.run_burst()
            finally:
                root_debug.removeHandler(handler)
            records = {name: await h.client.get(job_id) for name, job_id in jobs.items()}
    assert records.pop("ok").status == "succeeded"
    found = failure_lines(stream)
    assert sorted(line["job"] for line in found) == sorted(r.id for r in records.values())
    by_name = {name: next(x for x in found if x["job"] == r.id) for name, r in records.items()}
    for name, record in records.items():
        line, error = by_name[name], record.error
        assert record.status == "failed" and error is not None, name
        assert line["level"] == "WARNING" and line["logger"] == "chatstream.pipeline", line
        assert (line["code"], line["error"]) == (error["code"], error["message"]), name
        assert line["status"] == error.get("status"), name
        assert line["attempt"] == record.attempt, name
        status = error.get("status", "-")
        assert line["message"].startswith(
            f"job {record.id} attempt {record.attempt} failed: code={error['code']} "
            f"upstream={line['upstream']} status={status} error={json.dumps(error['message'])}"
        ), line["message"]
    assert by_name["401"]["status"] == 401 and by_name["401"]["upstream"] == "default"
    assert by_name["401"]["upstream_message"] == "mock: HTTP 401"
    assert by_name["exhausted_retries"]["status"] == 500
    refused = by_name["refused"]
    assert refused["upstream"] == "closed" and refused["status"] is None
    assert f"connection refused by 127.0.0.1:{refused_port}" in refused["message"]
    assert by_name["echo"]["upstream_message"] == "bad credentials: Bearer [REDACTED]"
    assert echo_key not in stream.getvalue()
    assert by_name["malformed"]["error"].startswith("malformed record: no status field")
    assert by_name["attempts_exhausted"]["code"] == "attempts_exhausted"


async def enqueue_failures(h: Harness) -> dict[str, str]:
    """One job per way of failing, plus one that succeeds."""
    jobs = {
        "ok": await h.client.enqueue(chat("fine")),
        "401": await h.client.enqueue(chat("a", fault="http_401")),
        "exhausted_retries": await h.client.enqueue(chat("b", fault="http_500")),
        "refused": await h.client.enqueue(chat("c"), upstream="closed"),
        "echo": await h.client.enqueue(chat("d"), upstream="echo"),
        "invalid_request": await inject(h, {"request": '{"model": "m"}'}),
        "malformed": await inject(h, {"request": json.dumps(chat("e"))}),
        "attempts_exhausted": await inject(h, {"request": json.dumps(chat("f")), "attempt": "3"}),
    }
    await h.redis.hdel(h.client.keys.job(jobs["malformed"]), "status")
    return jobs


async def test_the_failure_line_in_text_format(
    harness: Harness, root_debug: logging.Logger
) -> None:
    stream = io.StringIO()
    handler = logs.build_handler(harness.settings, stream)
    root_debug.addHandler(handler)
    try:
        record = await harness.run(chat("x", fault="http_404"))
    finally:
        root_debug.removeHandler(handler)
    [line] = [x for x in stream.getvalue().splitlines() if " failed: code=" in x]
    assert line.endswith(
        f" WARNING chatstream.pipeline: job {record.id} attempt 1 failed: "
        "code=upstream_terminal upstream=default status=404 "
        'error="upstream \'default\' returned HTTP 404" upstream_message="mock: HTTP 404" '
        f"[job={record.id} attempt=1]"
    )


async def test_every_line_about_a_job_carries_its_id(
    harness: Harness, root_debug: logging.Logger
) -> None:
    """Lines logged by background tasks about a job (the cancel) and by the start script's
    failures (attempts exhausted) carry the job and attempt too."""
    stream = io.StringIO()
    handler = logs.build_handler(json_settings(harness.settings), stream)
    root_debug.addHandler(handler)
    try:
        exhausted = await inject(harness, {"request": json.dumps(chat("g")), "attempt": "3"})
        running = await harness.client.enqueue(chat("slow", tokens=2000, rate=50))
        burst = asyncio.create_task(harness.worker.run_burst())
        events = harness.client.keys.events(running)
        assert await harness.redis.xread({events: "0-0"}, count=1, block=10_000)
        assert await harness.client.cancel(running) == "requested"
        await asyncio.wait_for(burst, 15)
    finally:
        root_debug.removeHandler(handler)
    assert (await harness.client.get(running)).status == "cancelled"
    ours = [line for line in lines(stream) if line["logger"].startswith("chatstream")]
    for job_id in (exhausted, running):
        about = [line for line in ours if job_id in line["message"]]
        assert about, job_id
        for line in about:
            assert line.get("job") == job_id, line
            assert "attempt" in line, line
    assert any("cancel requested" in line["message"] for line in ours)


# -- the start-up line ------------------------------------------------------------------


async def test_the_start_up_line_describes_the_configuration_without_secrets(
    settings: Settings, redis: Redis, root_debug: logging.Logger
) -> None:
    """One INFO line: Redis host/db/TLS and user (no password), prefix, upstreams by name
    and URL (no keys, no headers), concurrency, lease, event loop and Redis parser."""
    secrets = ("s3cret-redis-pw", "sk-default-key", "sk-named-key", "hdr-secret")
    configured = json_settings(
        settings,
        redis_url=f"rediss://chatstream:{secrets[0]}@redis.internal:6380/2",
        upstream_url="https://api.example.com/v1",
        upstream_api_key=SecretStr(secrets[1]),
        upstreams={
            "local": Upstream(
                url="http://vllm.internal:8000/v1",
                api_key=SecretStr(secrets[2]),
                headers={"Authorization": f"Bearer {secrets[3]}", "X-Title": "app"},
            )
        },
        concurrency=17,
        lease_seconds=12,
    )
    line, stream = await start_up_line(configured, redis, root_debug, "w-startup")
    assert line["level"] == "INFO" and line["logger"] == "chatstream.worker"
    assert line["message"] == (
        "worker w-startup started: redis chatstream@redis.internal:6380/2 tls=on "
        f"prefix={configured.prefix} upstreams: default=https://api.example.com/v1 "
        "local=http://vllm.internal:8000/v1 concurrency=17 lease=12s event_loop=asyncio "
        f"redis_parser={PARSER} http_transport={chosen_transport(configured)}"
    )
    assert line["upstreams"] == {
        "default": "https://api.example.com/v1",
        "local": "http://vllm.internal:8000/v1",
    }
    assert (line["event_loop"], line["redis_parser"]) == ("asyncio", PARSER)
    assert line["http_transport"] in ("httptools", "httpx")
    assert not any("UPSTREAM_URL is not set" in x["message"] for x in lines(stream))
    text = stream.getvalue()
    for secret in secrets:
        assert secret not in text


async def test_an_unconfigured_default_upstream_is_a_warning(
    redis: Redis, prefix: str, root_debug: logging.Logger
) -> None:
    bare = Settings(_env_file=None, prefix=prefix, log_format="json")  # nothing configured
    stream = io.StringIO()
    handler = logs.build_handler(bare, stream)
    root_debug.addHandler(handler)
    worker = Worker(bare, redis)
    try:
        await worker.startup()
        await worker.shutdown()
    finally:
        root_debug.removeHandler(handler)
    [warning] = [x for x in lines(stream) if x["level"] == "WARNING"]
    assert warning["message"].startswith(
        "CHATSTREAM_UPSTREAM_URL is not set: jobs for the upstream 'default' go to the "
        "built-in http://127.0.0.1:8400/v1"
    )


async def test_runtime_choices_name_the_loop_and_the_parser(redis: Redis) -> None:
    import fakeredis

    assert runtime_choices(redis) == RuntimeChoices("asyncio", PARSER)
    fake = fakeredis.FakeAsyncRedis()
    assert runtime_choices(fake).redis_parser == "fakeredis"
    await fake.aclose()
