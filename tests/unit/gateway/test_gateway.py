"""The HTTP gateway end to end: real redis-server, worker, mock upstream, uvicorn on loopback.

Streams (format, ids, usage, [DONE], failures), resume (live and finished, Last-Event-ID and
?after=), the native format, keep-alives, idempotency, the job endpoints, and clients that
vanish or stall. Auth, limits and bad input are in test_gateway_limits.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from httpx_sse import ServerSentEvent
from redis.asyncio import Redis

from schemas.jobs import JobStatus
from tests.helpers.checks import eventually
from tests.helpers.gateway_env import (
    KEY,
    OTHER_KEY,
    GatewayEnv,
    chunks_of,
    collect,
    content_of,
    parse_frames,
    running_gateway,
    sse_events,
)
from tests.helpers.harness import MOCK, chat
from worker.service.worker import Worker
from worker.settings import Settings
from worker.testing.mock_upstream import MockUpstream, expected_reply, expected_usage

COMPLETIONS = "/v1/chat/completions"
ASYNC = {"prefer": "respond-async"}


@pytest.fixture
async def gw(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[GatewayEnv]:
    async with running_gateway(settings, redis, mock_upstream, gateway_send_timeout=1.0) as env:
        yield env


def streaming(request: dict[str, Any], usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {**request, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def create_job(http: httpx.AsyncClient, request: dict[str, Any]) -> str:
    response = await http.post(COMPLETIONS, json=streaming(request), headers=ASYNC)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


async def entry_ids(gw: GatewayEnv, job_id: str, kind: str | None = None) -> list[str]:
    rows: Any = await gw.redis.xrange(gw.client.keys.events(job_id))
    return [entry_id for entry_id, fields in rows if kind is None or fields["type"] == kind]


def delta_event_ids(events: list[ServerSentEvent]) -> list[str]:
    """The id of every event that carries a delta (one per delta entry)."""
    return [
        e.id
        for e in events
        if e.data != "[DONE]" and any(c["delta"] for c in json.loads(e.data)["choices"])
    ]


async def health(gw: GatewayEnv) -> dict[str, Any]:
    async with gw.http(None) as http:
        body: dict[str, Any] = (await http.get("/healthz")).json()
        return body


# -- the streamed reply -----------------------------------------------------------------------


async def test_a_streamed_reply_is_openai_chunks_with_entry_ids(gw: GatewayEnv) -> None:
    request = chat("hi", tokens=5, tool_calls=1)
    async with gw.http() as http, http.stream("POST", COMPLETIONS, json=streaming(request)) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        job_id = r.headers["x-chatstream-job-id"]
        events = await collect(r)
    assert events[-1].data == "[DONE]"
    chunks = chunks_of(events)
    assert content_of(chunks) == expected_reply(request, MOCK)
    assert all(c["id"] == f"chatcmpl-{job_id}" and c["model"] == "mock-model" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish, usage = chunks[-2], chunks[-1]
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]
    assert usage["choices"] == [] and usage["usage"] == expected_usage(request, MOCK)
    assert delta_event_ids(events) == await entry_ids(gw, job_id, "delta")
    assert events[-1].id == (await entry_ids(gw, job_id))[-1]  # the terminal entry


async def test_without_include_usage_there_is_no_usage_chunk(gw: GatewayEnv) -> None:
    request = streaming(chat("hi", tokens=3), usage=False)
    async with gw.http() as http, http.stream("POST", COMPLETIONS, json=request) as response:
        chunks = chunks_of(await collect(response))
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_non_streamed_reply_is_a_chat_completion(gw: GatewayEnv) -> None:
    request = chat("hi there", tokens=4, tool_calls=2)
    async with gw.http() as http:
        response = await http.post(COMPLETIONS, json=request)
    assert response.status_code == 200, response.text
    body = response.json()
    job_id = response.headers["x-chatstream-job-id"]
    record = await gw.client.get(job_id)
    assert body["object"] == "chat.completion" and body["id"] == f"chatcmpl-{job_id}"
    assert body["choices"][0]["message"]["content"] == record.content
    assert body["choices"][0]["message"]["tool_calls"] == record.tool_calls
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == record.usage == expected_usage(request, MOCK)
    assert response.headers["x-chatstream-served-by"] == "default; model=mock-model"


async def test_a_midstream_failure_ends_with_an_error_chunk_and_no_done(gw: GatewayEnv) -> None:
    request = chat("hi", tokens=8, fault="midstream_error", fault_after=3)
    async with gw.http() as http, http.stream("POST", COMPLETIONS, json=streaming(request)) as r:
        assert r.status_code == 200
        events = await collect(r)
    assert all(e.data != "[DONE]" for e in events)
    chunks = chunks_of(events)
    assert content_of(chunks) == "tok0 tok1 tok2"
    last = chunks[-1]
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}]
    assert last["error"]["code"] == "upstream_stream_error"
    assert "failed mid-stream" in last["error"]["message"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
async def test_a_failure_before_any_output_is_an_http_error(gw: GatewayEnv, stream: bool) -> None:
    request = chat("hi", fault="http_404")
    async with gw.http() as http:
        response = await http.post(COMPLETIONS, json={**request, "stream": stream})
    assert response.status_code == 404
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["x-chatstream-job-id"]
    error = response.json()["error"]
    assert error["code"] == "upstream_terminal" and "HTTP 404" in error["message"]


# -- resume -----------------------------------------------------------------------------------


async def test_a_client_cut_off_mid_stream_resumes_live_with_last_event_id(
    gw: GatewayEnv,
) -> None:
    request = chat("hi", tokens=40, rate=50.0)
    first: list[ServerSentEvent] = []
    async with gw.http() as http:
        async with http.stream("POST", COMPLETIONS, json=streaming(request)) as response:
            job_id = response.headers["x-chatstream-job-id"]
            async for event in sse_events(response):
                first.append(event)
                if len(first) == 5:
                    break  # the connection is dropped here
        assert (await gw.client.get(job_id)).status is JobStatus.RUNNING  # live, not cancelled
        headers = {"last-event-id": first[-1].id}
        async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
            rest = await collect(response)
    assert (await gw.client.get(job_id)).status is JobStatus.SUCCEEDED
    events = first + rest
    assert content_of(chunks_of(events)) == expected_reply(request, MOCK)
    assert delta_event_ids(events) == await entry_ids(gw, job_id, "delta")  # no gap, no dup
    assert rest[-1].data == "[DONE]"


@pytest.mark.parametrize("how", ["last-event-id", "after", "both"])
async def test_a_finished_job_resumes_with_exactly_the_rest(gw: GatewayEnv, how: str) -> None:
    request = chat("hi", tokens=12, chunk_tokens=1, rate=200.0)
    async with gw.http() as http:
        job_id = await create_job(http, request)
        await gw.client.result(job_id, timeout=10)
        ids = await entry_ids(gw, job_id)
        cut = ids[len(ids) // 2]
        url, headers = f"/v1/jobs/{job_id}/events", {}
        if how in ("last-event-id", "both"):
            headers["last-event-id"] = cut
        if how in ("after", "both"):
            url += f"?after={ids[0] if how == 'both' else cut}"  # the header wins
        async with http.stream("GET", url, headers=headers) as response:
            rest = await collect(response)
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            whole = await collect(response)
    position = max(i for i, event in enumerate(whole) if event.id == cut)
    assert [(e.id, e.data) for e in rest] == [(e.id, e.data) for e in whole[position + 1 :]]
    assert content_of(chunks_of(whole)) == expected_reply(request, MOCK)
    assert rest[-1].data == "[DONE]"


async def test_a_client_cut_off_inside_the_terminal_entry_gets_all_of_it_again(
    gw: GatewayEnv,
) -> None:
    """The done entry is three events (finish chunk, usage chunk, [DONE]); its id rides on
    the last. A client that got only the finish chunk resumes before the entry and gets
    the usage chunk and [DONE] (the finish chunk again), never a token twice."""
    request = chat("hi", tokens=4)
    async with gw.http() as http:
        job_id = await create_job(http, request)
        await gw.client.result(job_id, timeout=10)
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            whole = await collect(response)
        finish = next(i for i, e in enumerate(whole) if '"finish_reason":"stop"' in e.data)
        seen = whole[: finish + 1]  # cut off right after the finish chunk
        headers = {"last-event-id": seen[-1].id}
        async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
            rest = await collect(response)
    assert seen[-1].id == (await entry_ids(gw, job_id, "delta"))[-1]  # before the done entry
    assert [e.data for e in rest] == [e.data for e in whole[finish:]]
    assert [c["usage"] for c in chunks_of(rest) if c.get("usage")]
    assert rest[-1].data == "[DONE]" and rest[-1].id == (await entry_ids(gw, job_id))[-1]
    assert content_of(chunks_of(seen + rest)) == expected_reply(request, MOCK)


async def test_resuming_after_the_terminal_entry(gw: GatewayEnv) -> None:
    async with gw.http() as http:
        done = await create_job(http, chat("hi", tokens=3))
        failed = await create_job(http, chat("hi", tokens=3, fault="midstream_error"))
        for job_id in (done, failed):
            await gw.client.result(job_id, timeout=10)
        last_done = (await entry_ids(gw, done))[-1]
        last_failed = (await entry_ids(gw, failed))[-1]
        r1 = await http.get(f"/v1/jobs/{done}/events", headers={"last-event-id": last_done})
        r2 = await http.get(f"/v1/jobs/{failed}/events", headers={"last-event-id": last_failed})
    assert r1.text == "data: [DONE]\n\n"  # only the end marker was left
    assert r2.text == ""


async def test_the_native_format_is_the_stream_entries(gw: GatewayEnv) -> None:
    async with gw.http() as http:
        job_id = await create_job(http, chat("hi", tokens=6, reasoning=2))
        url = f"/v1/jobs/{job_id}/events?format=chatstream"
        async with http.stream("GET", url) as response:
            events = await collect(response)
    stored = [event async for event in gw.client.events(job_id)]
    assert [json.loads(e.data) for e in events] == [e.model_dump(mode="json") for e in stored]
    assert [e.id for e in events] == [e.id for e in stored]


async def test_an_idle_stream_gets_keepalives_and_ends_when_cancelled(idle: GatewayEnv) -> None:
    async with idle.http() as http:
        job_id = await create_job(http, chat("hi"))
        raw = b""
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            async for data in response.aiter_raw():
                raw += data
                if raw.count(b": keep-alive\n\n") == 2:
                    cancel = await http.post(f"/v1/jobs/{job_id}/cancel")
                    assert cancel.json() == {"id": job_id, "status": "cancelled"}
    events = [e for e in raw.split(b"\n\n") if e.startswith((b"id:", b"retry:"))]
    assert len(events) == 1 and b"data: [DONE]" not in raw
    chunk = json.loads(events[0].split(b"data: ", 1)[1])
    assert chunk["error"]["code"] == "cancelled"
    assert chunk["choices"][0]["finish_reason"] == "error"


async def test_a_stream_whose_job_expires_ends_with_an_error(idle: GatewayEnv) -> None:
    async with idle.http() as http:
        job_id = await create_job(http, chat("hi"))
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            await idle.redis.delete(idle.client.keys.job(job_id))  # as its TTL would
            events = await collect(response)
    assert chunks_of(events)[-1]["error"]["code"] == "job_expired"


# -- idempotency and the job endpoints ------------------------------------------------------


async def test_an_idempotency_key_makes_the_same_job(gw: GatewayEnv) -> None:
    request = chat("same", tokens=4)
    key_a = {"idempotency-key": "order-42"}
    async with gw.http(**key_a) as http, gw.http(OTHER_KEY, **key_a) as other:
        first = await http.post(COMPLETIONS, json=request)
        async with http.stream("POST", COMPLETIONS, json=streaming(request)) as again:
            replay = await collect(again)
        changed = await http.post(COMPLETIONS, json=chat("different"))
        theirs = await other.post(COMPLETIONS, json=request)
    job_id = first.headers["x-chatstream-job-id"]
    assert again.headers["x-chatstream-job-id"] == job_id
    assert content_of(chunks_of(replay)) == first.json()["choices"][0]["message"]["content"]
    assert gw.mock.requests["/v1/chat/completions"] == 2  # ours once, the other key's once
    assert changed.status_code == 400
    assert changed.json()["error"]["code"] == "idempotency_key_reused"
    assert theirs.status_code == 200 and theirs.headers["x-chatstream-job-id"] != job_id


async def test_get_and_cancel_a_job_of_ones_own_key_only(idle: GatewayEnv) -> None:
    async with idle.http() as http, idle.http(OTHER_KEY) as other:
        job_id = await create_job(http, chat("hi"))
        mine = await http.get(f"/v1/jobs/{job_id}")
        theirs = [
            await other.get(f"/v1/jobs/{job_id}"),
            await other.get(f"/v1/jobs/{job_id}/events"),
            await other.post(f"/v1/jobs/{job_id}/cancel"),
        ]
        unknown = await http.get("/v1/jobs/no-such-job")
        still_queued = (await http.get(f"/v1/jobs/{job_id}")).json()["status"]
        cancelled = await http.post(f"/v1/jobs/{job_id}/cancel")
    assert mine.status_code == 200
    assert mine.json()["id"] == job_id and mine.json()["status"] == "queued"
    assert mine.json()["request"]["messages"] == chat("hi")["messages"]
    for response in [*theirs, unknown]:
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"
    assert theirs[0].json() == {
        "error": {
            "message": f"no job {job_id!r}",
            "type": "invalid_request_error",
            "param": None,
            "code": "job_not_found",
        }
    }
    assert still_queued == "queued"
    assert cancelled.json() == {"id": job_id, "status": "cancelled"}


# -- clients that go away or stall -------------------------------------------------------------


async def test_disconnecting_cancels_the_job_only_when_asked(gw: GatewayEnv) -> None:
    request = streaming(chat("hi", tokens=100, rate=50.0))
    async with gw.http() as http:
        jobs = []
        for headers in ({}, {"x-chatstream-cancel-on-disconnect": "true"}):
            async with http.stream("POST", COMPLETIONS, json=request, headers=headers) as r:
                jobs.append(r.headers["x-chatstream-job-id"])
                await anext(sse_events(r))  # then the connection is dropped
        jobs.append(await create_job(http, request))
        async with http.stream("GET", f"/v1/jobs/{jobs[2]}/events?cancel_on_disconnect=1") as r:
            await anext(sse_events(r))
    kept, *cancelled = jobs

    async def cancelled_ones() -> bool:
        states = [(await gw.client.get(job_id)).status for job_id in cancelled]
        return states == [JobStatus.CANCELLED] * 2

    await eventually(cancelled_ones, timeout=10)
    assert (await gw.client.result(kept, timeout=10)).status is JobStatus.SUCCEEDED
    assert (await health(gw))["open_streams"] == 0


async def test_a_vanished_client_frees_its_slot_and_the_job_goes_on(gw: GatewayEnv) -> None:
    request = chat("hi", tokens=60, rate=60.0)
    async with gw.http() as http:
        job_id = await create_job(http, request)
        async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            await anext(sse_events(response))
            assert (await health(gw))["followed_jobs"] == 1

    async def released() -> bool:
        counts = await health(gw)
        return bool(counts["open_streams"] == 0 and counts["followed_jobs"] == 0)

    await eventually(released, timeout=5)
    record = await gw.client.result(job_id, timeout=10)
    assert record.status is JobStatus.SUCCEEDED and record.content == expected_reply(request, MOCK)


async def test_many_clients_of_one_job_share_one_read(idle: GatewayEnv) -> None:
    """20 clients wait on a queued job: the hub follows it once; when a worker runs it,
    every client gets the same events."""
    request = chat("hi", tokens=30, rate=200.0)
    async with idle.http() as http:
        job_id = await create_job(http, request)

        async def read() -> list[ServerSentEvent]:
            async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
                return await collect(response)

        readers = [asyncio.create_task(read()) for _ in range(20)]

        async def all_waiting() -> bool:
            counts = await health(idle)
            return bool(counts["followed_jobs"] == 1 and counts["open_streams"] == 20)

        await eventually(all_waiting, timeout=10)
        worker = Worker(idle.settings, idle.redis)
        await worker.startup()
        try:
            await worker.run_burst()
        finally:
            await worker.shutdown()
        results = await asyncio.gather(*readers)
    for events in results:
        assert [(e.id, e.data) for e in events] == [(e.id, e.data) for e in results[0]]
    assert content_of(chunks_of(results[0])) == expected_reply(request, MOCK)


async def test_a_stalled_client_blocks_neither_the_worker_nor_other_clients(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """A client that stops reading a 4 MB reply (more than loopback's socket buffers hold):
    the worker still finishes the job and other clients stream theirs while the stalled
    stream stays blocked in its write; when that client finally goes, its slot is freed.
    (The send timeout that drops such a client is tested in test_gateway_parts.py, the byte
    bound that drops it sooner, here set above the reply, in tests/system.)"""
    big = chat("big", tokens=4000, words="x" * 1000)
    async with (
        running_gateway(
            settings,
            redis,
            mock_upstream,
            gateway_send_timeout=3600,
            gateway_client_buffer_bytes=64 * 2**20,
        ) as gw,
        gw.http() as http,
    ):
        job_id = await create_job(http, big)
        stalled = await _stalled_reader(gw, job_id, KEY)
        try:
            await eventually(lambda: _streams_open(gw, 1), timeout=5)
            for request in [chat(f"other {i}", tokens=20) for i in range(5)]:
                async with http.stream("POST", COMPLETIONS, json=streaming(request)) as r:
                    reply = content_of(chunks_of(await collect(r)))
                    assert reply == expected_reply(request, MOCK)
            assert (await gw.client.result(job_id, timeout=30)).status is JobStatus.SUCCEEDED
            assert await _streams_open(gw, 1)  # still blocked writing the stalled reply
        finally:
            stalled.close()
        await eventually(lambda: _streams_open(gw, 0), timeout=10)


async def _streams_open(gw: GatewayEnv, count: int) -> bool:
    return bool((await health(gw))["open_streams"] == count)


async def _stalled_reader(gw: GatewayEnv, job_id: str, key: str) -> socket.socket:
    """A connection that asks for the job's events and then never reads."""
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    request = (
        f"GET /v1/jobs/{job_id}/events HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {key}\r\n\r\n"
    )
    await asyncio.get_running_loop().sock_sendall(sock, request.encode())
    return sock


async def test_waiting_entries_are_comments_or_named_events_for_the_page(idle: GatewayEnv) -> None:
    """A job that waited, then finished: by default its stream carries the waiting entry
    as a comment an SDK skips; ``?progress=events`` (the page) as ``event: waiting``."""
    async with idle.http() as http:
        job_id = await create_job(http, chat("hi"))
        record, events_key = idle.client.keys.job(job_id), idle.client.keys.events(job_id)
        await idle.redis.hset(record, mapping={"status": "running", "attempt": "1"})
        waiting = {"reason": "upstream_down", "upstream": "default", "since_ms": 1, "for_s": 2.0}
        assert await idle.client.records.notice(job_id, 1, "waiting", json.dumps(waiting))
        await idle.redis.xadd(
            events_key, {"type": "delta", "attempt": "1", "data": '{"content":"x"}'}
        )
        done = '{"finish_reason":"stop","usage":null}'
        await idle.redis.xadd(events_key, {"type": "done", "attempt": "1", "data": done})
        await idle.redis.hset(record, "status", "succeeded")
        plain = await http.get(f"/v1/jobs/{job_id}/events")
        page = await http.get(f"/v1/jobs/{job_id}/events?progress=events")
        bad = await http.get(f"/v1/jobs/{job_id}/events?progress=loud")
    assert plain.status_code == page.status_code == 200
    assert "\n: waiting {" in plain.text or plain.text.startswith(": waiting {")
    assert [e.event for e in parse_frames(plain.text)] == ["message"] * 3  # delta, finish, [DONE]
    named = [e for e in parse_frames(page.text) if e.event == "waiting"]
    assert [json.loads(e.data) for e in named] == [waiting] and named[0].id == ""
    assert [e.data for e in parse_frames(page.text) if e.event == "message"] == [
        e.data for e in parse_frames(plain.text)
    ]
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_progress"
