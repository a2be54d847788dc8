"""Upstream faults end to end: worker, real Redis, mock upstream; one test per fault.

Each test asserts the documented outcome (docs/failures.md): retried and succeeded,
failed with a clear error code and message, and whether partial output is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.extras import TRANSPORTS
from tests.helpers.harness import Harness, chat, custom_harness
from tests.helpers.servers import free_port
from tests.helpers.tls import make_certs
from worker.settings import Upstream
from worker.testing.mock_upstream import MockConfig, expected_reply

PARTIAL = "tok0 tok1 tok2"  # what the mock sends before a fault at fault_after=3


def faulty(fault: str | None = None, **mock: Any) -> tuple[dict[str, Any], str]:
    """A request with a mock fault and a unique key (to count this job's upstream calls)."""
    key = uuid.uuid4().hex
    options: dict[str, Any] = {"key": key, **mock}
    if fault is not None:
        options["fault"] = fault
    return chat("hi", **options), key


async def run_with(h: Harness, request: dict[str, Any]) -> tuple[JobRecord, list[StreamEvent]]:
    record = await h.run(request)
    return record, await h.events(record.id)


def assert_failed(
    record: JobRecord, events: list[StreamEvent], code: str, message: str, content: str = ""
) -> dict[str, Any]:
    """The job failed with ``code``, a message containing ``message``, and ``content`` kept."""
    assert record.status == "failed", record
    assert record.error is not None
    assert record.error["code"] == code, record.error
    assert message in record.error["message"], record.error
    assert record.content == content
    assert events[-1].type is EventType.ERROR
    assert events[-1].data["error"] == record.error
    published = "".join(e.data.get("content", "") for e in events if e.type is EventType.DELTA)
    assert published == content  # the stream and the record agree on the partial output
    return record.error


def assert_succeeded(h: Harness, record: JobRecord, request: dict[str, Any]) -> None:
    assert record.status == "succeeded", record.error
    assert record.content == expected_reply(request, h.mock.config)


# -- before the first byte: retried -----------------------------------------------------


async def test_429_waits_for_retry_after_then_succeeds(harness: Harness) -> None:
    # the backoff is at most 0.05 s (conftest); only honouring Retry-After waits 0.4 s
    request, key = faulty("http_429", fail_times=1, retry_after=0.4)
    began = time.monotonic()
    record = await harness.run(request)
    assert time.monotonic() - began >= 0.4
    assert_succeeded(harness, record, request)
    assert harness.mock.key_requests[key] == 2


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_5xx_is_retried_then_succeeds(harness: Harness, status: int) -> None:
    request, key = faulty(f"http_{status}", fail_times=2)
    record = await harness.run(request)
    assert_succeeded(harness, record, request)
    assert harness.mock.key_requests[key] == 3


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_5xx_every_time_fails_after_retry_attempts(harness: Harness, status: int) -> None:
    async with custom_harness(harness, retry_attempts=3) as h:
        request, key = faulty(f"http_{status}")
        record, events = await run_with(h, request)
    error = assert_failed(
        record,
        events,
        "upstream_retryable",
        f"upstream 'default' returned HTTP {status} (gave up after 3 attempts)",
    )
    assert error["status"] == status
    assert error["detail"]["message"] == f"mock: HTTP {status}"
    assert harness.mock.key_requests[key] == 3


async def test_connection_refused_is_retried_then_fails(harness: Harness) -> None:
    port = free_port()
    async with custom_harness(
        harness, upstream_url=f"http://127.0.0.1:{port}/v1", retry_attempts=2
    ) as h:
        record, events = await run_with(h, chat("hi"))
    assert_failed(
        record,
        events,
        "upstream_retryable",
        f"upstream 'default': connection refused by 127.0.0.1:{port} (nothing listens there)"
        " (gave up after 2 attempts)",
    )


@asynccontextmanager
async def tls_server(directory: Path) -> AsyncIterator[int]:
    """A TLS server with a certificate from a private CA the worker does not trust; it
    reads whatever comes and hangs up."""
    certs = make_certs(directory)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            await reader.read(1024)
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()


async def test_dns_refusal_and_tls_failures_are_told_apart(
    harness: Harness, tmp_path: Path
) -> None:
    """Each failure before the first byte says what happened, with the host and port."""
    mock_port = urlsplit(harness.settings.upstream_url).port
    refused = free_port()
    async with tls_server(tmp_path) as tls_port:
        upstreams = {
            "dns": "http://no-such-host.invalid:8400/v1",
            "refused": f"http://127.0.0.1:{refused}/v1",
            "not_tls": f"https://127.0.0.1:{mock_port}/v1",  # https to a plain HTTP server
            "untrusted": f"https://127.0.0.1:{tls_port}/v1",
            "plain_to_tls": f"http://127.0.0.1:{tls_port}/v1",
        }
        config = {name: Upstream(url=url) for name, url in upstreams.items()}
        async with custom_harness(harness, upstreams=config, retry_attempts=1) as h:
            jobs = {name: await h.client.enqueue(chat("hi"), upstream=name) for name in upstreams}
            await h.worker.run_burst()
            records = {name: await h.client.get(job) for name, job in jobs.items()}
    expected = {
        "dns": "upstream 'dns': cannot resolve host 'no-such-host.invalid' (DNS: ",
        "refused": f"upstream 'refused': connection refused by 127.0.0.1:{refused} ",
        "not_tls": f"upstream 'not_tls': TLS handshake with 127.0.0.1:{mock_port} failed "
        "(WRONG_VERSION_NUMBER) (the server does not speak TLS: use http://?)",
        "untrusted": f"upstream 'untrusted': TLS certificate of 127.0.0.1:{tls_port} not trusted (",
        "plain_to_tls": f"upstream 'plain_to_tls': no HTTP response from 127.0.0.1:{tls_port} "
        "(Server disconnected without sending a response.) (a TLS port reached with http://?)",
    }
    for name, record in records.items():
        events = await harness.events(record.id)
        error = assert_failed(record, events, "upstream_retryable", expected[name])
        assert error["message"].endswith("(gave up after 1 attempt)"), error


@asynccontextmanager
async def resetting_server() -> AsyncIterator[tuple[str, list[float]]]:
    """A server that reads the request, then resets the connection (TCP RST)."""
    accepted: list[float] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(time.monotonic())
        await reader.read(1024)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1", accepted
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()


async def test_reset_before_the_first_byte_is_retried_then_fails(harness: Harness) -> None:
    async with (
        resetting_server() as (url, accepted),
        custom_harness(harness, upstream_url=url, retry_attempts=3) as h,
    ):
        record, events = await run_with(h, chat("hi"))
    port = urlsplit(url).port
    reset = f"127.0.0.1:{port} dropped the connection before the first byte (connection reset"
    assert_failed(record, events, "upstream_retryable", reset)
    assert "(gave up after 3 attempts)" in record.error["message"]  # type: ignore[index]
    assert len(accepted) == 3


async def test_drop_after_headers_before_the_first_byte_is_retried(harness: Harness) -> None:
    request, key = faulty("disconnect", fault_after=0, fail_times=1)
    record = await harness.run(request)
    assert_succeeded(harness, record, request)
    assert harness.mock.key_requests[key] == 2


async def test_no_first_byte_in_time_is_retried_then_succeeds(harness: Harness) -> None:
    async with custom_harness(harness, first_byte_timeout=0.2) as h:
        request, key = faulty("no_first_byte", stall_seconds=3, fail_times=1)
        record = await h.run(request)
    assert_succeeded(harness, record, request)
    assert harness.mock.key_requests[key] == 2


async def test_no_first_byte_every_time_fails_with_timeout(harness: Harness) -> None:
    async with custom_harness(harness, first_byte_timeout=0.2, retry_attempts=2) as h:
        request, key = faulty("no_first_byte", stall_seconds=3)
        began = time.monotonic()
        record, events = await run_with(h, request)
    assert time.monotonic() - began < 2
    assert_failed(
        record,
        events,
        "upstream_timeout",
        "upstream 'default': no first byte in 0.2s (gave up after 2 attempts)",
    )
    assert harness.mock.key_requests[key] == 2


# -- after the first byte: not retried by default; partial output kept ------------------


async def test_stall_beyond_idle_timeout_fails_and_keeps_partial_output(harness: Harness) -> None:
    async with custom_harness(harness, idle_timeout=0.2) as h:
        request, key = faulty("stall", stall_seconds=3, fault_after=3)
        began = time.monotonic()
        record, events = await run_with(h, request)
    assert time.monotonic() - began < 2
    assert_failed(
        record, events, "upstream_timeout", "upstream 'default': no data for 0.2s", PARTIAL
    )
    assert harness.mock.key_requests[key] == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_upstream_dripping_an_event_fails_as_stalled_mid_event(
    harness: Harness, transport: str
) -> None:
    """One byte every 20 ms of an event that never ends: each byte used to restart the read
    timeout, so only the job timeout ended it. The idle timeout counts complete events."""
    settings = {"idle_timeout": 0.3, "job_timeout": 20, "http_transport": transport}
    async with custom_harness(harness, **settings) as h:
        request, key = faulty("drip", drip_seconds=0.02, fault_after=3)
        record, events = await run_with(h, request)
    error = assert_failed(
        record,
        events,
        "upstream_timeout",
        "upstream 'default': stalled mid-event: sent ",
        PARTIAL,
    )
    assert "bytes of an event but no complete SSE event or comment for 0.3s" in error["message"]
    sent = int(error["message"].split("sent ")[1].split(" bytes")[0])
    assert sent > len('data: {"id":')  # the head of the event, and then some
    assert harness.mock.key_requests[key] == 1


async def test_a_dripping_upstream_is_retried_like_an_idle_timeout(harness: Harness) -> None:
    """With retry_after_output the stalled attempt is followed by a new one (a reset)."""
    settings = {"idle_timeout": 0.3, "job_timeout": 20, "retry_after_output": True}
    async with custom_harness(harness, **settings) as h:
        request, key = faulty("drip", drip_seconds=0.02, fault_after=3, fail_times=1)
        record, events = await run_with(h, request)
    assert_succeeded(harness, record, request)
    assert (record.attempt, harness.mock.key_requests[key]) == (2, 2)
    assert [e.type for e in events].count(EventType.RESET) == 1


async def test_disconnect_mid_stream_fails_and_keeps_partial_output(harness: Harness) -> None:
    request, key = faulty("disconnect", fault_after=3, fail_times=1)
    record, events = await run_with(harness, request)
    assert_failed(
        record, events, "upstream_retryable", "upstream 'default' disconnected mid-stream", PARTIAL
    )
    assert harness.mock.key_requests[key] == 1  # retry_after_output is off by default
    assert EventType.RESET not in [e.type for e in events]


async def test_job_timeout_fails_and_keeps_partial_output(harness: Harness) -> None:
    async with custom_harness(harness, job_timeout=0.5) as h:
        request, key = faulty(tokens=400, rate=20.0)
        began = time.monotonic()
        record, events = await run_with(h, request)
    assert time.monotonic() - began < 2
    published = "".join(e.data.get("content", "") for e in events if e.type is EventType.DELTA)
    assert published.startswith("tok0 tok1 tok2")
    assert_failed(record, events, "upstream_timeout", "job exceeded 0.5s", published)
    assert harness.mock.key_requests[key] == 1


async def test_truncated_stream_fails_and_keeps_partial_output(harness: Harness) -> None:
    request, key = faulty("truncate", fault_after=3)
    record, events = await run_with(harness, request)
    assert_failed(record, events, "truncated", "ended without [DONE] or a finish_reason", PARTIAL)
    assert harness.mock.key_requests[key] == 1


async def test_retry_after_output_starts_a_new_attempt_with_reset(harness: Harness) -> None:
    async with custom_harness(harness, retry_after_output=True) as h:
        request, key = faulty("disconnect", fault_after=3, fail_times=1)
        record, events = await run_with(h, request)
    assert_succeeded(harness, record, request)
    assert record.attempt == 2
    assert harness.mock.key_requests[key] == 2
    types = [e.type for e in events]
    reset = types.index(EventType.RESET)
    first = "".join(e.data.get("content", "") for e in events[:reset])
    assert first == PARTIAL
    assert all(e.attempt == 1 for e in events[:reset])
    assert all(e.attempt == 2 for e in events[reset:])
    after = [e for e in events[reset + 1 :] if e.type is EventType.DELTA]
    assert "".join(e.data.get("content", "") for e in after) == record.content
    assert types[-1] is EventType.DONE


async def test_retry_after_output_still_fails_a_terminal_error(harness: Harness) -> None:
    """An error chunk that is not "try again" (a 400 invalid_request_error) ends the job."""
    async with custom_harness(harness, retry_after_output=True) as h:
        request, key = faulty("midstream_error", fault_after=3, error_status=400)
        record, events = await run_with(h, request)
    assert_failed(record, events, "upstream_stream_error", "mock: upstream failed", PARTIAL)
    assert harness.mock.key_requests[key] == 1


# -- protocol faults: terminal, partial output kept --------------------------------------


async def test_midstream_error_chunk_fails_with_the_upstream_error(harness: Harness) -> None:
    request, key = faulty("midstream_error", fault_after=3)
    record, events = await run_with(harness, request)
    error = assert_failed(
        record, events, "upstream_stream_error", "mock: upstream failed mid-stream", PARTIAL
    )
    assert error["detail"]["type"] == "server_error"
    assert harness.mock.key_requests[key] == 1


async def test_json_error_body_with_http_200_fails(harness: Harness) -> None:
    request, key = faulty("json_200")
    record, events = await run_with(harness, request)
    error = assert_failed(
        record,
        events,
        "upstream_terminal",
        "returned HTTP 200 with content-type 'application/json', not text/event-stream",
    )
    assert error["detail"]["message"] == "mock: error in a 200 response"
    assert harness.mock.key_requests[key] == 1


async def test_wrong_content_type_fails(harness: Harness) -> None:
    request, key = faulty("wrong_content_type")
    record, events = await run_with(harness, request)
    error = assert_failed(
        record, events, "upstream_terminal", "content-type 'text/plain; charset=utf-8'"
    )
    assert "not an event stream" in error["detail"]
    assert harness.mock.key_requests[key] == 1


async def test_malformed_json_fails_with_protocol_error(harness: Harness) -> None:
    request, key = faulty("malformed_json", fault_after=3)
    record, events = await run_with(harness, request)
    assert_failed(record, events, "protocol", "invalid JSON in SSE data", PARTIAL)
    assert harness.mock.key_requests[key] == 1


async def test_oversized_event_fails_and_keeps_partial_output(harness: Harness) -> None:
    async with custom_harness(harness, max_event_bytes=4096) as h:
        request, key = faulty("oversized_event", fault_after=3, oversized_mb=0.01)
        record, events = await run_with(h, request)
    assert_failed(record, events, "event_too_large", "4096", PARTIAL)
    assert harness.mock.key_requests[key] == 1


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_terminal_4xx_fails_at_once_with_the_upstream_error(
    harness: Harness, status: int
) -> None:
    request, key = faulty(f"http_{status}")
    record, events = await run_with(harness, request)
    error = assert_failed(
        record, events, "upstream_terminal", f"upstream 'default' returned HTTP {status}"
    )
    assert error["status"] == status
    assert error["detail"]["message"] == f"mock: HTTP {status}"
    assert harness.mock.key_requests[key] == 1


async def test_keepalive_comments_are_ignored(harness: Harness) -> None:
    request, _ = faulty("keepalive", keepalive_every=1)
    record = await harness.run(request)
    assert_succeeded(harness, record, request)


async def test_the_worker_goes_on_after_every_fault(harness: Harness) -> None:
    """Many faulty jobs in one burst, then a plain one: the same worker runs them all."""
    faults = ["http_400", "midstream_error", "malformed_json", "truncate", "json_200"]
    ids = [await harness.client.enqueue(faulty(f, fault_after=2)[0]) for f in faults]
    await harness.worker.run_burst()
    records = [await harness.client.get(job_id) for job_id in ids]
    assert [r.status for r in records] == ["failed"] * len(faults)
    request = chat("after", tokens=5)
    record = await harness.run(request)
    assert record.content == expected_reply(request, MockConfig())
    assert record.status == "succeeded"
