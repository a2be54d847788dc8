"""End to end in one process: real redis-server, mock upstream on loopback, one worker.

Every test reads the job's whole events stream straight from Redis (XRANGE, not through
the client that stops at the first terminal entry) and checks it against the record with
:func:`check_stream`: exactly one terminal entry, last, of the type the status implies,
and the merged deltas equal the recorded message.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers.checks import (
    check_stream,
    final_tool_calls,
    merge_deltas,
    queue_is_empty,
    stream_entries,
)
from tests.helpers.harness import MOCK, Harness, chat
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.keys import Keys
from worker.testing.mock_upstream import (
    MockConfig,
    expected_reasoning,
    expected_reply,
    expected_tool_calls,
    expected_usage,
)
from worker.upstream.client import UpstreamClient

# -- helpers ----------------------------------------------------------------------------------


SERVED = {"upstream": "default", "model": "mock-model"}


async def finished(harness: Harness, record: JobRecord) -> list[StreamEvent]:
    """The job's stream, checked; also what a consumer reading from the start sees."""
    events = await stream_entries(harness.redis, harness.worker.keys, record.id)
    check_stream(events, record)
    assert await harness.events(record.id) == events
    return events


@asynccontextmanager
async def started_worker(
    settings: Settings, redis: Redis, upstream: UpstreamClient | None = None
) -> AsyncIterator[tuple[Worker, Client]]:
    """A worker with custom settings (the harness's are fixed) and a client for it."""
    worker = Worker(settings, redis, upstream)
    await worker.startup()
    try:
        yield worker, Client.from_settings(settings, redis)
    finally:
        await worker.shutdown()


# -- successful jobs ----------------------------------------------------------------------


async def test_plain_text_job_streams_deltas_and_records_the_reply(harness: Harness) -> None:
    request = chat("hi there", tokens=30)
    record = await harness.run(request)
    config = MockConfig(tokens=30)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, config)
    assert record.usage == expected_usage(request, config)
    assert record.finish_reason == "stop"
    assert record.attempt == 1
    assert record.worker == harness.worker.name
    assert record.model == "mock-model"
    assert record.completion_id is not None and record.completion_id.startswith("chatcmpl-mock")
    assert record.created_at is not None and record.started_at is not None
    assert record.finished_at is not None
    assert record.created_at <= record.started_at <= record.finished_at
    assert record.request is not None and record.request["messages"][0]["content"] == "hi there"
    events = await finished(harness, record)
    assert [e.type for e in events] == [EventType.DELTA] * (len(events) - 1) + [EventType.DONE]
    assert {e.attempt for e in events} == {1}
    merged = merge_deltas(events)
    assert merged.role == "assistant"
    assert merged.content == expected_reply(request, config)
    assert await queue_is_empty(harness.redis, harness.worker.keys)


async def test_max_tokens_ends_with_finish_reason_length(harness: Harness) -> None:
    request = {**chat("cut me short", tokens=40), "max_tokens": 7}
    record = await harness.run(request)
    assert record.status == "succeeded"
    assert record.finish_reason == "length"
    assert record.content == expected_reply(request, MOCK)
    assert record.content.split() == [f"tok{i}" for i in range(7)]
    await finished(harness, record)


async def test_parallel_tool_calls(harness: Harness) -> None:
    request = chat("use the tools", tokens=3, tool_calls=2)
    record = await harness.run(request)
    expected = expected_tool_calls(request, MOCK)
    assert len(expected) == 2
    assert record.status == "succeeded"
    assert record.finish_reason == "tool_calls"
    assert record.tool_calls == expected
    assert [json.loads(c["function"]["arguments"]) for c in record.tool_calls] == [
        {"index": 0, "query": "q0"},
        {"index": 1, "query": "q1"},
    ]
    events = await finished(harness, record)
    merged = merge_deltas(events)
    assert final_tool_calls(merged) == expected
    assert record.usage == expected_usage(request, MOCK)


async def test_reasoning_is_streamed_and_recorded(harness: Harness) -> None:
    request = chat("think first", tokens=5, reasoning=6)
    record = await harness.run(request)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, MOCK)
    assert "".join(entry["text"] for entry in record.reasoning) == expected_reasoning(request, MOCK)
    assert [entry["type"] for entry in record.reasoning] == ["reasoning.text"]
    events = await finished(harness, record)
    merged = merge_deltas(events)
    assert "".join(e["text"] for e in merged.reasoning_details) == "".join(
        f"step {i}. " for i in range(6)
    )
    assert record.usage == expected_usage(request, MOCK)


def _sse(*chunks: dict[str, Any] | str) -> bytes:
    parts = [c if isinstance(c, str) else json.dumps(c) for c in chunks]
    return "".join(f"data: {part}\n\n" for part in parts).encode()


async def run_canned(
    settings: Settings, redis: Redis, body: bytes
) -> tuple[JobRecord, list[StreamEvent], list[dict[str, Any]]]:
    """Run one job against an upstream that answers every request with ``body`` (SSE)."""
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        upstream = UpstreamClient(settings, http)
        async with started_worker(settings, redis, upstream) as (worker, client):
            job_id = await client.enqueue(chat("count"))
            await worker.run_burst()
            record = await client.get(job_id)
            events = await stream_entries(redis, worker.keys, job_id)
    check_stream(events, record)
    return record, events, sent


HEAD = {"id": "c1", "model": "m"}


def _choice(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {**HEAD, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


async def test_usage_keeps_the_last_non_null_value(settings: Settings, redis: Redis) -> None:
    """An upstream that sends usage twice (and nulls in between): the last one wins."""
    first = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    last = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = _sse(
        _choice({"role": "assistant", "content": "a"}),
        {**_choice({"content": "b"}), "usage": first},
        {**_choice({}, "stop"), "usage": None},
        {**HEAD, "choices": [], "usage": last},
        {**HEAD, "choices": [], "usage": None},
        "[DONE]",
    )
    record, events, sent = await run_canned(settings, redis, body)
    assert record.status == "succeeded"
    assert record.content == "ab"
    assert record.usage == last
    assert events[-1].data == {"finish_reason": "stop", "usage": last, "served": SERVED}
    assert sent[0]["stream"] is True
    assert sent[0]["stream_options"] == {"include_usage": True}


async def test_a_finish_reason_without_done_is_a_complete_stream(
    settings: Settings, redis: Redis
) -> None:
    """Only a stream with neither [DONE] nor a finish_reason is truncated."""
    body = _sse(_choice({"role": "assistant", "content": "whole"}), _choice({}, "stop"))
    record, _, sent = await run_canned(settings, redis, body)
    assert record.status == "succeeded", record.error
    assert record.content == "whole"
    assert record.finish_reason == "stop"
    assert len(sent) == 1


async def test_a_stream_without_finish_reason_or_done_is_truncated(
    settings: Settings, redis: Redis
) -> None:
    body = _sse(_choice({"role": "assistant", "content": "half"}))
    record, _, sent = await run_canned(settings, redis, body)
    assert record.status == "failed"
    assert record.error is not None and record.error["code"] == "truncated"
    assert record.content == "half"
    assert len(sent) == 1  # output was published: not retried (default policy)


# -- failures -----------------------------------------------------------------------------


async def test_midstream_error_fails_and_keeps_the_partial_output(harness: Harness) -> None:
    request = chat("break", tokens=20, fault="midstream_error", fault_after=5, key="mid")
    record = await harness.run(request)
    assert record.status == "failed"
    assert record.content == "tok0 tok1 tok2 tok3 tok4"
    assert record.finish_reason == "error"
    assert record.error is not None
    assert record.error["code"] == "upstream_stream_error"
    assert record.error["message"] == "mock: upstream failed mid-stream"
    assert record.error["detail"] == {
        "message": "mock: upstream failed mid-stream",
        "type": "server_error",
        "code": 502,
    }
    events = await finished(harness, record)
    assert events[-1].type is EventType.ERROR
    assert events[-1].data["error"] == record.error
    assert merge_deltas(events).content == "tok0 tok1 tok2 tok3 tok4"
    assert harness.mock.key_requests["mid"] == 1  # terminal: not retried
    assert await queue_is_empty(harness.redis, harness.worker.keys)


async def test_http_400_is_terminal_and_keeps_the_upstream_error(harness: Harness) -> None:
    request = chat("bad", fault="http_400", key="k400")
    record = await harness.run(request)
    assert record.status == "failed"
    assert harness.mock.key_requests["k400"] == 1
    assert record.error is not None
    assert record.error["code"] == "upstream_terminal"
    assert record.error["status"] == 400
    assert "HTTP 400" in record.error["message"]
    assert record.error["detail"] == {
        "message": "mock: HTTP 400",
        "type": "invalid_request_error",
        "code": 400,
    }
    assert record.content == ""
    events = await finished(harness, record)
    assert [e.type for e in events] == [EventType.ERROR]
    assert await queue_is_empty(harness.redis, harness.worker.keys)


@pytest.mark.parametrize("fault", ["http_429", "http_503"])
async def test_retryable_status_is_retried_until_it_succeeds(harness: Harness, fault: str) -> None:
    key = f"retry-{fault}"
    request = chat("again", tokens=8, fault=fault, fail_times=2, key=key, retry_after=0)
    record = await harness.run(request)
    assert record.status == "succeeded", record.error
    assert harness.mock.key_requests[key] == 3
    assert record.attempt == 1  # retried before the first byte: the same attempt
    assert record.content == expected_reply(request, MOCK)
    events = await finished(harness, record)
    assert EventType.RESET not in [e.type for e in events]


async def test_retryable_status_gives_up_after_the_configured_tries(
    settings: Settings, redis: Redis, mock_upstream: Any
) -> None:
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "retry_attempts": 2})
    async with started_worker(settings, redis) as (worker, client):
        job_id = await client.enqueue(chat("no", fault="http_503", key="down"))
        await worker.run_burst()
        record = await client.get(job_id)
        events = await stream_entries(redis, worker.keys, job_id)
    assert record.status == "failed"
    assert mock.key_requests["down"] == 2
    assert record.error is not None
    assert record.error["status"] == 503
    assert record.error["code"] == "upstream_retryable"
    assert "gave up after 2 attempts" in record.error["message"]
    check_stream(events, record)


async def test_truncated_stream_after_output_fails_with_partial_output(harness: Harness) -> None:
    request = chat("cut", tokens=20, fault="truncate", fault_after=4, key="trunc")
    record = await harness.run(request)
    assert record.status == "failed"
    assert record.error is not None
    assert record.error["code"] == "truncated"
    assert record.content == "tok0 tok1 tok2 tok3"
    assert record.finish_reason is None
    assert harness.mock.key_requests["trunc"] == 1  # output was published: no retry
    events = await finished(harness, record)
    assert merge_deltas(events).content == "tok0 tok1 tok2 tok3"


async def test_truncated_stream_before_output_is_retried(harness: Harness) -> None:
    request = chat("cut", tokens=10, fault="truncate", fault_after=0, fail_times=1, key="t0")
    record = await harness.run(request)
    assert record.status == "succeeded", record.error
    assert harness.mock.key_requests["t0"] == 2
    assert record.attempt == 1
    assert record.content == expected_reply(request, MOCK)
    events = await finished(harness, record)
    assert EventType.RESET not in [e.type for e in events]


async def test_truncated_stream_is_retried_as_a_new_attempt_when_allowed(
    settings: Settings, redis: Redis, mock_upstream: Any
) -> None:
    """``retry_after_output``: a reset entry voids the first attempt's deltas."""
    mock, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url, "retry_after_output": True})
    request = chat("cut", tokens=10, fault="truncate", fault_after=4, fail_times=1, key="t4")
    async with started_worker(settings, redis) as (worker, client):
        job_id = await client.enqueue(request)
        await worker.run_burst()
        record = await client.get(job_id)
        events = await stream_entries(redis, worker.keys, job_id)
    assert record.status == "succeeded", record.error
    assert record.attempt == 2
    assert mock.key_requests["t4"] == 2
    assert record.content == expected_reply(request, MOCK)
    types = [e.type for e in events]
    assert types.count(EventType.RESET) == 1
    reset = types.index(EventType.RESET)
    assert {e.attempt for e in events[:reset]} == {1}
    assert {e.attempt for e in events[reset:]} == {2}
    assert merge_deltas(events[:reset]).content == "tok0 tok1 tok2 tok3"
    check_stream(events, record)


# -- bad input never kills the worker -----------------------------------------------------


async def _write_raw_job(harness: Harness, job_id: str, **fields: str) -> None:
    """A record written directly with the keys.py layout, plus its queue entry."""
    keys = harness.worker.keys
    record: dict[Any, Any] = {
        "id": job_id,
        "status": "queued",
        "upstream": "default",
        "created_at": f"{time.time():.6f}",
        "attempt": "0",
        "metadata": "{}",
        **fields,
    }
    await harness.redis.hset(keys.job(job_id), mapping=record)
    await harness.redis.xadd(keys.queue, {"job": job_id})


@pytest.mark.parametrize(
    ("request_json", "message"),
    [
        ('{"model": "m", "messages": [', "invalid request: body: Invalid JSON"),
        ('{"model": "m"}', "invalid request: messages: Field required"),
        ('{"model": " ", "messages": [{"role": "user"}]}', "invalid request: model: "),
        ("[1, 2]", "invalid request: body: Input should be an object"),
    ],
)
async def test_invalid_request_fails_the_job_and_the_worker_goes_on(
    harness: Harness, request_json: str, message: str
) -> None:
    await _write_raw_job(harness, "bad-job", request=request_json)
    good = await harness.client.enqueue(chat("fine"))
    assert await harness.worker.run_burst() == 2
    record = await harness.client.get("bad-job")
    assert record.status == "failed"
    assert record.error is not None
    assert record.error["code"] == "invalid_job"
    assert record.error["message"].startswith(message), record.error["message"]
    assert record.attempt == 1
    events = await finished(harness, record)
    assert [e.type for e in events] == [EventType.ERROR]
    assert (await harness.client.get(good)).status == "succeeded"
    assert harness.mock.requests["/v1/chat/completions"] == 1  # only the good job went out
    assert await queue_is_empty(harness.redis, harness.worker.keys)


async def test_unknown_upstream_in_a_stored_job_fails_it(harness: Harness) -> None:
    await _write_raw_job(harness, "elsewhere", request=json.dumps(chat()), upstream="nowhere")
    await harness.worker.run_burst()
    record = await harness.client.get("elsewhere")
    assert record.status == "failed"
    assert record.error is not None
    assert record.error["code"] == "unknown_upstream"
    assert "'nowhere'" in record.error["message"]
    await finished(harness, record)
    assert harness.mock.requests["/v1/chat/completions"] == 0


async def test_garbage_and_dangling_queue_entries_are_dropped(harness: Harness) -> None:
    keys = harness.worker.keys
    await harness.redis.xadd(keys.queue, {"foo": "bar"})
    await harness.redis.xadd(keys.queue, {"job": "ghost"})  # no record
    good = await harness.client.enqueue(chat("still here"))
    assert await harness.worker.run_burst() == 3
    assert (await harness.client.get(good)).status == "succeeded"
    assert await harness.redis.exists(keys.job("ghost"), keys.events("ghost")) == 0
    assert await queue_is_empty(harness.redis, keys)
    assert await harness.redis.xlen(keys.dead) == 0
    # and the worker still takes new work afterwards
    record = await harness.run(chat("after"))
    assert record.status == "succeeded"


async def test_a_finished_job_delivered_again_is_not_rerun(harness: Harness) -> None:
    record = await harness.run(chat("once", key="once"))
    await harness.redis.xadd(harness.worker.keys.queue, {"job": record.id})  # a duplicate
    await harness.worker.run_burst()
    assert harness.mock.key_requests["once"] == 1
    again = await harness.client.get(record.id)
    assert again == record
    await finished(harness, again)
    assert await queue_is_empty(harness.redis, harness.worker.keys)


# -- retention, coalescing ----------------------------------------------------------------


async def _ttls(redis: Redis, keys: Keys, job_id: str) -> tuple[int, int]:
    return int(await redis.ttl(keys.job(job_id))), int(await redis.ttl(keys.events(job_id)))


async def test_records_and_streams_expire_after_the_retention(
    settings: Settings, redis: Redis, mock_upstream: Any
) -> None:
    _, url = mock_upstream
    retention = 300
    settings = settings.model_copy(update={"upstream_url": url, "retention_seconds": retention})
    async with started_worker(settings, redis) as (worker, client):
        ok = await client.enqueue(chat("keep a while"))
        record_ttl, stream_ttl = await _ttls(redis, worker.keys, ok)
        assert 0 < record_ttl <= retention
        assert stream_ttl == -2  # no stream yet
        failed = await client.enqueue(chat("fail", fault="http_400"))
        cancelled = await client.enqueue(chat("never"))
        assert await client.cancel(cancelled) == "cancelled"
        await worker.run_burst()
        for job_id, status in ((ok, "succeeded"), (failed, "failed"), (cancelled, "cancelled")):
            assert (await client.get(job_id)).status == status
            record_ttl, stream_ttl = await _ttls(redis, worker.keys, job_id)
            assert 0 < record_ttl <= retention, (status, record_ttl)
            assert 0 < stream_ttl <= retention, (status, stream_ttl)


async def test_fast_upstream_deltas_are_coalesced(harness: Harness) -> None:
    request = chat("flood", tokens=2000, rate=0)
    record = await harness.run(request)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, MOCK)
    events = await finished(harness, record)
    deltas = [e for e in events if e.type is EventType.DELTA]
    assert len(deltas) < 2000 / 10, len(deltas)  # about 20 here; one per token without
    assert merge_deltas(events).content == record.content
    assert [e.data.get("role") for e in deltas].count("assistant") == 1
