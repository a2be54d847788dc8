"""Hostile input never kills a worker.

Invalid or oversized job payloads, unknown upstreams, missing or expired records and
garbage queue entries end the job ``failed`` with a clear error (or drop the entry with a
log line when there is no record), and the same worker then runs the next job. Hypothesis
throws arbitrary bytes and JSON at the pure parts (SSE decoder, accumulator, job loader),
and arbitrary bytes from an upstream through the whole pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from schemas.jobs import JobStatus
from tests.helpers.checks import merged, output_of
from tests.helpers.fakes import InstantGateWaits
from tests.helpers.harness import Harness, chat, custom_harness, inject
from tests.helpers.servers import RedisServer
from worker.client import Client
from worker.errors import InvalidJobError, ProtocolError
from worker.protocol.accumulator import Accumulator
from worker.protocol.sse import SSEDecoder
from worker.service.pipeline import load_request
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.records import dumps
from worker.store.redis_client import redis_from_settings
from worker.upstream.client import UpstreamClient

WORKER_LOG = "chatstream.worker"


async def assert_next_job_succeeds(h: Harness) -> None:
    record = await h.run(chat("next", tokens=4))
    assert record.status == "succeeded"
    assert record.content == "tok0 tok1 tok2 tok3"


async def run_failed(h: Harness, fields: dict[str, Any]) -> dict[str, Any]:
    job_id = await inject(h, fields)
    await h.worker.run_burst()
    record = await h.client.get(job_id)
    assert record.status == "failed", record
    assert record.error is not None
    events = await h.events(job_id)
    assert events[-1].type == "error"
    assert events[-1].data["error"] == record.error
    return record.error


# -- invalid jobs: failed with a clear error, the worker goes on ---------------------------


@pytest.mark.parametrize(
    ("request_json", "message"),
    [
        ("not json", "invalid request: body: Invalid JSON"),
        ("[1, 2]", "invalid request: body: Input should be an object"),
        ("{}", "invalid request: model: Field required"),
        ('{"model": "m", "messages": []}', "invalid request: messages: List should have at least"),
        ('{"model": "  ", "messages": [{"role": "user"}]}', "model must not be blank"),
        ('{"model": "m", "messages": [{"role": ""}]}', "invalid request: messages.0.role"),
        ('{"model": "m", "messages": "hi"}', "invalid request: messages: Input should be"),
        ("[" * 100_000, "recursion limit exceeded"),
        ("", "invalid request: body: Invalid JSON"),
    ],
)
async def test_an_invalid_request_fails_the_job(
    harness: Harness, request_json: str, message: str
) -> None:
    error = await run_failed(harness, {"request": request_json})
    assert error["code"] == "invalid_job"
    assert message in error["message"]
    assert sum(harness.mock.requests.values()) == 0
    await assert_next_job_succeeds(harness)


async def test_a_record_without_a_request_fails_the_job(harness: Harness) -> None:
    error = await run_failed(harness, {})
    assert error["code"] == "invalid_job"
    await assert_next_job_succeeds(harness)


async def test_an_oversized_request_fails_the_job(harness: Harness) -> None:
    async with custom_harness(harness, max_request_bytes=2048) as h:
        big = json.dumps(chat("x" * 4000))
        error = await run_failed(h, {"request": big})
        assert error == {
            "code": "invalid_job",
            "message": "request is larger than the limit of 2048 bytes",
        }
        with pytest.raises(InvalidJobError, match="larger than the limit of 2048 bytes"):
            await h.client.enqueue(chat("x" * 4000))
        await assert_next_job_succeeds(h)
    assert sum(harness.mock.requests.values()) == 1  # only the next job reached it


async def test_an_unknown_upstream_fails_the_job(harness: Harness) -> None:
    fields = {"request": json.dumps(chat("hi")), "upstream": "nope"}
    error = await run_failed(harness, fields)
    assert error == {
        "code": "unknown_upstream",
        "message": "unknown upstream 'nope'; configured: ['default']",
    }
    await assert_next_job_succeeds(harness)


@pytest.mark.parametrize("name", ["nope", "http://127.0.0.1:1/v1", "", "a" * 65, "../x"])
async def test_the_client_refuses_an_unknown_upstream(harness: Harness, name: str) -> None:
    with pytest.raises(InvalidJobError, match="upstream"):
        await harness.client.enqueue(chat("hi"), upstream=name)
    assert await harness.redis.xlen(harness.worker.keys.queue) == 0


@pytest.mark.parametrize(
    "request_body",
    [{"model": "m"}, {"messages": []}, {"model": "", "messages": [{"role": "user"}]}, {}],
)
async def test_the_client_refuses_an_invalid_request(
    harness: Harness, request_body: dict[str, Any]
) -> None:
    with pytest.raises(InvalidJobError, match="invalid job"):
        await harness.client.enqueue(request_body)


# -- no record: dropped with a log line -----------------------------------------------------


async def test_an_entry_without_a_record_is_dropped_and_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    await harness.client.queue.add("ghost")
    with caplog.at_level(logging.ERROR, WORKER_LOG):
        await harness.worker.run_burst()
    assert "job ghost has no record (expired or never created); dropping" in caplog.messages
    assert await harness.redis.xlen(harness.worker.keys.queue) == 0
    assert not await harness.redis.exists(harness.worker.keys.job("ghost"))
    await assert_next_job_succeeds(harness)


async def test_an_expired_record_is_dropped_and_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = await harness.client.enqueue(chat("expires"))
    await harness.redis.pexpire(harness.worker.keys.job(job_id), 1)
    await asyncio.sleep(0.01)
    with caplog.at_level(logging.ERROR, WORKER_LOG):
        await harness.worker.run_burst()
    assert f"job {job_id} has no record (expired or never created); dropping" in caplog.messages
    assert await harness.redis.xlen(harness.worker.keys.queue) == 0
    assert sum(harness.mock.requests.values()) == 0
    await assert_next_job_succeeds(harness)


@pytest.mark.parametrize(
    "fields",
    [{"foo": "bar"}, {"job": ""}, {"job": "x" * 10_000}, {"job": "}{:*"}, {"jobs": "a", "x": "y"}],
)
async def test_a_garbage_queue_entry_is_dropped_and_logged(
    harness: Harness, caplog: pytest.LogCaptureFixture, fields: dict[Any, Any]
) -> None:
    await harness.redis.xadd(harness.worker.keys.queue, fields)
    with caplog.at_level(logging.ERROR, WORKER_LOG):
        assert await harness.worker.run_burst() == 1
    assert any("dropping" in m for m in caplog.messages), caplog.messages
    assert await harness.redis.xlen(harness.worker.keys.queue) == 0
    await assert_next_job_succeeds(harness)


async def test_bytes_that_are_not_utf8_in_the_queue_do_not_stop_the_worker(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # the Redis client the CLI gives a worker (redis_from_settings) replaces bad bytes
    redis = redis_from_settings(harness.settings)
    worker = Worker(harness.settings, redis)
    await worker.startup()
    try:
        raw = Redis.from_url(harness.settings.redis_url)  # no decoding: writes raw bytes
        await raw.xadd(worker.keys.queue, {b"job": b"\xff\xfe\x80", b"\xc3": b"\xff"})
        await raw.aclose()
        with caplog.at_level(logging.ERROR, WORKER_LOG):
            assert await worker.run_burst() == 1
        assert any("dropping" in m for m in caplog.messages), caplog.messages
        h = Harness(harness.settings, redis, harness.mock, worker, harness.client)
        await assert_next_job_succeeds(h)
        assert await redis.xlen(worker.keys.queue) == 0
    finally:
        await worker.shutdown()
        await redis.aclose()


async def test_a_record_with_bytes_that_are_not_utf8_fails_the_job(harness: Harness) -> None:
    redis = redis_from_settings(harness.settings)
    worker = Worker(harness.settings, redis)
    await worker.startup()
    try:
        client = Client.from_settings(harness.settings, redis)
        h = Harness(harness.settings, redis, harness.mock, worker, client)
        raw = Redis.from_url(harness.settings.redis_url)
        job_id = await inject(h, {"request": "placeholder"})
        await raw.hset(worker.keys.job(job_id), b"request", b'{"model":\xff\xfe}')
        await raw.aclose()
        await worker.run_burst()
        record = await h.client.get(job_id)
        assert record.status == "failed"
        assert record.error is not None
        assert record.error["code"] == "invalid_job"
        await assert_next_job_succeeds(h)
    finally:
        await worker.shutdown()
        await redis.aclose()


# -- fuzzing the pure parts -----------------------------------------------------------------

SSE_PIECES = [
    b"data: ",
    b"data:",
    b"\n",
    b"\n\n",
    b"\r\n",
    b"\r",
    b": keep-alive\n\n",
    b"event: x\n",
    b"id: 1\n",
    b"retry: 10\n",
    b"[DONE]",
    b'{"choices":[{"index":0,"delta":{"content":"x"}}]}',
    b'{"choices":[{"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"c"}]}}]}',
    b'{"choices":[{"delta":{},"finish_reason":"stop"}]}',
    b'{"error":{"message":"boom"}}',
    b'{"usage":{"total_tokens":1},"choices":[]}',
    b'{"choices":[{"delta":{"reasoning_details":[{"type":"reasoning.text","text":"r"}]}}]}',
    b'{"choices":null}',
    b"\xef\xbb\xbf",
    b"\xff\xfe",
    b"{",
    b"}",
    b'"',
]
sse_bytes = st.lists(
    st.one_of(st.binary(max_size=40), st.sampled_from(SSE_PIECES)), max_size=40
).map(b"".join)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["assistant", "stop", "error", "function", "reasoning.text", "[DONE]"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "delta",
                    "content",
                    "role",
                    "tool_calls",
                    "index",
                    "id",
                    "type",
                    "function",
                    "name",
                    "arguments",
                    "finish_reason",
                    "usage",
                    "error",
                    "message",
                    "reasoning_details",
                    "reasoning",
                    "reasoning_content",
                    "text",
                    "summary",
                    "model",
                    "messages",
                    "web_search",
                    "free_tier",
                ]
            )
            | st.text(max_size=8),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)
chunk_like = st.fixed_dictionaries(
    {"choices": st.lists(st.fixed_dictionaries({"delta": json_values}), max_size=2)},
    optional={"usage": json_values, "error": json_values, "id": json_values},
)
FUZZ = settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.too_slow])


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def feed_all(data: bytes, cuts: list[int], max_event_bytes: int) -> Accumulator:
    """The pipeline's pure chain: decoder -> accumulator -> a delta per read, published
    (valid UTF-8 JSON) and merged; they must merge to the final message."""
    decoder, acc, published = SSEDecoder(max_event_bytes), Accumulator(), []
    try:
        for piece in split(data, cuts):
            try:
                acc.fold_all(decoder.feed_data(piece))
            finally:
                if (delta := acc.take_delta()) is not None:
                    published.append(json.loads(dumps(delta).encode()))
    except ProtocolError:
        pass
    assert output_of(merged(published)) == output_of(acc.finish())
    return acc


@FUZZ
@given(data=sse_bytes, cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_fuzz_sse_bytes_through_decoder_and_accumulator(data: bytes, cuts: list[int]) -> None:
    feed_all(data, cuts, max_event_bytes=1 << 20)
    feed_all(data, cuts, max_event_bytes=16)


@FUZZ
@given(data=st.binary(max_size=2000), cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_fuzz_arbitrary_bytes_through_decoder_and_accumulator(data: bytes, cuts: list[int]) -> None:
    feed_all(data, cuts, max_event_bytes=64)


@FUZZ
@given(chunks=st.lists(st.one_of(json_values, chunk_like), max_size=8))
def test_fuzz_arbitrary_json_into_the_accumulator(chunks: list[Any]) -> None:
    acc = Accumulator()
    for chunk in chunks:
        with contextlib.suppress(ProtocolError):
            acc.fold_all([json.dumps(chunk).encode()])
        delta = acc.take_delta()
        if delta is not None:
            dumps(delta).encode()
    final = acc.finish()
    dumps([final.content, final.reasoning, final.tool_calls, final.usage, final.error]).encode()
    final.exception()


@FUZZ
@given(text=st.one_of(st.text(max_size=300), json_values.map(json.dumps)))
def test_fuzz_the_job_loader(text: str) -> None:
    try:
        body = load_request(text, 1024)
    except InvalidJobError as exc:
        assert exc.message.startswith(("invalid request: ", "request is larger"))
        return
    assert body["stream"] is True
    json.dumps(body, allow_nan=False)  # what httpx sends must encode


@FUZZ
@given(
    request=st.fixed_dictionaries(
        {"model": json_values, "messages": st.lists(json_values, max_size=3) | json_values},
        optional={"stream": json_values, "stream_options": json_values, "tools": json_values},
    )
)
def test_fuzz_the_job_loader_with_request_shaped_json(request: dict[str, Any]) -> None:
    test_fuzz_the_job_loader.hypothesis.inner_test(json.dumps(request))  # type: ignore[attr-defined]


# -- a hostile upstream through the whole pipeline -------------------------------------------

CODES = {
    "protocol",
    "event_too_large",
    "truncated",
    "upstream_stream_error",
    "upstream_retryable",
    "upstream_timeout",
    "upstream_terminal",
}


class HostileUpstream:
    """An httpx MockTransport handler answering each job with its scripted response."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self.responses = responses

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        script = self.responses[body["fuzz"]]
        headers = {"content-type": script["content_type"], **script["headers"]}
        return httpx.Response(script["status"], headers=headers, content=self.body(script))

    @staticmethod
    async def body(script: dict[str, Any]) -> AsyncIterator[bytes]:
        for chunk in script["chunks"]:
            yield chunk
        if script["reset"]:
            raise httpx.ReadError("connection reset by peer")


GOOD_EVENTS = [
    b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":" b\xc3\xa9"}}]}\n\n',
    b'data: {"choices":[{"delta":{"reasoning_details":[{"type":"reasoning.text","text":"t"}]}}]}'
    b"\n\n",
    b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f",'
    b'"arguments":"{}"}}]}}]}\n\n',
    b": keep-alive\n\n",
    b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n',
]
ENDINGS = [b"data: [DONE]\n\n", b"", b'data: {"error":{"message":"x"}}\n\n', b"data: {", b"\xff"]
wellformed = st.tuples(
    st.lists(st.sampled_from(GOOD_EVENTS), max_size=10).map(b"".join),
    st.sampled_from(ENDINGS),
    st.lists(st.integers(0, 2000), max_size=6),
).map(lambda t: split(t[0] + t[1], t[2]))
responses = st.fixed_dictionaries(
    {
        "status": st.sampled_from([200] * 8 + [400, 404, 429, 500, 503, 204, 302]),
        "content_type": st.sampled_from(
            ["text/event-stream"] * 4 + ["text/event-stream; charset=utf-8", "application/json", ""]
        ),
        "headers": st.dictionaries(
            st.sampled_from(["retry-after", "retry-after-ms", "x-junk"]),
            st.sampled_from(["1", "-1", "abc", "1e309", "nan", "Wed, 21 Oct 2015 07:28:00 GMT"]),
            max_size=2,
        ),
        "chunks": st.lists(sse_bytes, max_size=6) | wellformed,
        "reset": st.sampled_from([False, False, False, True]),
    }
)


async def run_hostile(url: str, scripts: list[dict[str, Any]]) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    config = Settings(
        _env_file=None,
        redis_url=url,
        prefix=prefix,
        block_ms=20,
        max_event_bytes=1024,
        retry_attempts=2,
        retry_initial_backoff=0,
        retry_max_backoff=0,
        job_timeout=5,
    )
    redis = Redis.from_url(url, decode_responses=True)
    http = httpx.AsyncClient(transport=httpx.MockTransport(HostileUpstream(scripts)))
    worker = Worker(config, redis, UpstreamClient(config, http))
    client = Client.from_settings(config, redis)
    await worker.startup()
    try:
        ids = [await client.enqueue({**chat("fuzz"), "fuzz": i}) for i in range(len(scripts))]
        async with asyncio.timeout(20):
            assert await worker.run_burst() == len(scripts)
        for job_id in ids:
            record = await client.get(job_id)
            assert record.status in (JobStatus.SUCCEEDED, JobStatus.FAILED), record
            if record.status is JobStatus.FAILED:
                assert record.error is not None
                assert record.error["code"] in CODES, record.error
    finally:
        await worker.shutdown()
        await http.aclose()
        await redis.aclose()


class Unexpected(logging.Handler):
    """Collects the worker's 'unexpected failure' reports (a bug escaped the error tree)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is not None:
            self.records.append(record)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(scripts=st.lists(responses, min_size=1, max_size=6))
def test_fuzz_a_hostile_upstream_never_crashes_the_worker(
    redis_server: RedisServer | None, scripts: list[dict[str, Any]]
) -> None:
    if redis_server is None:
        pytest.skip("needs redis-server")
    handler = Unexpected()
    logger = logging.getLogger("chatstream")
    logger.addHandler(handler)

    try:
        with InstantGateWaits().installed():
            asyncio.run(run_hostile(redis_server.url, scripts))
    finally:
        logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]
