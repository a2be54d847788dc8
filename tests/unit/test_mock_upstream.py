"""The fake upstream, exercised over real loopback HTTP with httpx."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from worker.testing.mock_upstream import (
    MockConfig,
    MockRequestError,
    MockUpstream,
    expected_reasoning,
    expected_reply,
    expected_tool_calls,
    expected_usage,
    resolve_options,
    serve_mock,
)

Events = list[tuple[str, str]]  # ("data" | "comment", text)
USER = [{"role": "user", "content": "say something nice"}]


@asynccontextmanager
async def served(**config: Any) -> AsyncIterator[tuple[MockUpstream, httpx.AsyncClient]]:
    app = MockUpstream(MockConfig(**config))
    async with (
        serve_mock(app=app) as url,
        httpx.AsyncClient(base_url=url, timeout=5.0) as client,
    ):
        yield app, client


def body(**fields: Any) -> dict[str, Any]:
    mock = fields.pop("mock", None)
    request: dict[str, Any] = {"model": "m1", "messages": USER, "stream": True, **fields}
    if mock is not None:
        request["mock"] = mock
    return request


async def stream(
    client: httpx.AsyncClient, request: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[httpx.Response, Events]:
    events: Events = []
    async with client.stream("POST", "/chat/completions", json=request, headers=headers) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events.append(("data", line[6:]))
            elif line.startswith(":"):
                events.append(("comment", line[1:].strip()))
    return resp, events


def chunks(events: Events) -> list[dict[str, Any]]:
    return [json.loads(text) for kind, text in events if kind == "data" and text != "[DONE]"]


def content(events: Events) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks(events) if c["choices"]
    )


def finish_reasons(events: Events) -> list[str]:
    return [
        c["choices"][0]["finish_reason"]
        for c in chunks(events)
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]


# --------------------------------------------------------------------------- pure helpers


def test_resolve_options_overrides_and_validates() -> None:
    config = MockConfig(tokens=4)
    options = resolve_options({"mock": {"tokens": 7, "rate": 5, "reasoning": True}}, config)
    assert (options.tokens, options.rate, options.reasoning) == (7, 5.0, 8)
    assert resolve_options({"max_tokens": 2}, config).finish_reason == "length"
    assert resolve_options({"mock": {"stall_after": 9}}, config).fault_after == 9
    for bad in ({"nope": 1}, {"tokens": "3"}, {"tokens": -1}, {"fault": "boom"}, {"rate": True}):
        with pytest.raises(MockRequestError):
            resolve_options({"mock": bad}, config)
    assert expected_reply({"mock": {"tokens": 3}}, config) == "tok0 tok1 tok2"
    assert expected_reply({"max_tokens": 1}, config) == "tok0"


# --------------------------------------------------------------------------- streams


async def test_plain_stream_matches_expected_reply() -> None:
    async with served(tokens=40) as (_, client):
        request = body()
        resp, events = await stream(client, request)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    parsed = chunks(events)
    assert content(events) == expected_reply(request, MockConfig(tokens=40))
    assert [c["choices"][0]["delta"].get("role") for c in parsed].count("assistant") == 1
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {c["id"] for c in parsed} == {parsed[0]["id"]}
    assert {c["object"] for c in parsed} == {"chat.completion.chunk"}
    assert parsed[0]["model"] == "m1"
    assert finish_reasons(events) == ["stop"]
    assert parsed[-1]["choices"][0]["delta"] == {}
    assert events[-1] == ("data", "[DONE]")
    assert all("usage" not in c for c in parsed)


async def test_words_are_cycled_into_the_reply() -> None:
    async with served(tokens=5, words="red green blue") as (_, client):
        request = body()
        _, events = await stream(client, request)
    assert content(events) == "red green blue red green"
    assert expected_reply(request, MockConfig(tokens=5, words="red green blue")) == (
        "red green blue red green"
    )


async def test_usage_chunk_before_done_when_asked() -> None:
    async with served(tokens=5) as (_, client):
        request = body(stream_options={"include_usage": True})
        _, events = await stream(client, request)
    usage_chunk = chunks(events)[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == expected_usage(request, MockConfig(tokens=5))
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert events[-1] == ("data", "[DONE]")


async def test_chunk_tokens_and_max_tokens() -> None:
    async with served(tokens=10) as (_, client):
        _, grouped = await stream(client, body(mock={"chunk_tokens": 4}))
        _, limited = await stream(client, body(max_tokens=3))
    assert [c["choices"][0]["delta"]["content"] for c in chunks(grouped)[:-1]] == [
        "tok0 tok1 tok2 tok3",
        " tok4 tok5 tok6 tok7",
        " tok8 tok9",
    ]
    assert content(limited) == "tok0 tok1 tok2"
    assert finish_reasons(limited) == ["length"]


async def test_tool_calls_stream_in_fragments() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    request = body(tools=tools, mock={"tokens": 0, "tool_calls": 2})
    async with served() as (_, client):
        _, events = await stream(client, request)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks(events):
        for fragment in chunk["choices"][0]["delta"].get("tool_calls", []):
            if "id" in fragment:
                assert fragment["function"]["arguments"] == ""
                assert fragment["type"] == "function"
                calls[fragment["index"]] = fragment
            else:
                assert set(fragment) == {"index", "function"}
                calls[fragment["index"]]["function"]["arguments"] += fragment["function"][
                    "arguments"
                ]
    accumulated = [{k: v for k, v in calls[i].items() if k != "index"} for i in sorted(calls)]
    assert accumulated == expected_tool_calls(request, MockConfig())
    assert [c["function"]["name"] for c in accumulated] == ["lookup", "lookup"]
    assert json.loads(accumulated[1]["function"]["arguments"]) == {"index": 1, "query": "q1"}
    assert finish_reasons(events) == ["tool_calls"]
    assert chunks(events)[0]["choices"][0]["delta"]["role"] == "assistant"


async def test_reasoning_fragments_come_before_content() -> None:
    request = body(mock={"tokens": 3, "reasoning": 4})
    async with served() as (_, client):
        _, events = await stream(client, request)
    deltas = [c["choices"][0]["delta"] for c in chunks(events)]
    kinds = ["reasoning" if "reasoning_details" in d else "content" for d in deltas if d]
    assert kinds == ["reasoning"] * 4 + ["content"] * 3
    details = [x for d in deltas for x in d.get("reasoning_details", [])]
    assert {x["type"] for x in details} == {"reasoning.text"}
    assert "".join(x["text"] for x in details) == expected_reasoning(request, MockConfig())
    assert content(events) == "tok0 tok1 tok2"


async def test_non_stream_completion_and_models() -> None:
    async with served(tokens=4) as (app, client):
        resp = await client.post("/chat/completions", json=body(stream=False))
        models = await client.get("/models")
        missing = await client.get("/nowhere")
    completion = resp.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"] == {
        "role": "assistant",
        "content": "tok0 tok1 tok2 tok3",
    }
    assert completion["usage"]["completion_tokens"] == 4
    assert models.json()["data"][0]["id"] == "mock-model"
    assert missing.status_code == 404
    assert app.requests["/v1/chat/completions"] == 1
    assert app.requests["/v1/models"] == 1


async def test_batched_fast_stream_is_complete() -> None:
    async with served(tokens=2000) as (app, client):
        _, events = await stream(client, body())
    assert content(events) == expected_reply({}, MockConfig(tokens=2000))
    assert app.open_streams == 0
    assert app.streams_started == 1


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize("status", [400, 401, 429, 500, 502, 503])
async def test_http_faults(status: int) -> None:
    async with served() as (_, client):
        resp = await client.post("/chat/completions", json=body(mock={"fault": f"http_{status}"}))
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["code"] == status
    assert ("retry-after" in resp.headers) == (status == 429)


async def test_fail_times_then_success_per_key() -> None:
    fault = {"fault": "http_503", "fail_times": 2}
    async with served(tokens=2) as (app, client):
        first = [
            (await client.post("/chat/completions", json=body(mock={**fault, "key": "a"})))
            for _ in range(3)
        ]
        other = await client.post("/chat/completions", json=body(mock={**fault, "key": "b"}))
        resp, events = await stream(client, body(mock={**fault, "key": "a"}))
    assert [r.status_code for r in first] == [503, 503, 200]
    assert other.status_code == 503
    assert resp.status_code == 200
    assert content(events) == "tok0 tok1"
    assert app.key_requests == {"a": 4, "b": 1}


async def test_api_key_required() -> None:
    async with served(api_key="sekret") as (_, client):
        none = await client.post("/chat/completions", json=body(stream=False))
        wrong = await client.post(
            "/chat/completions", json=body(stream=False), headers={"Authorization": "Bearer x"}
        )
        resp, events = await stream(client, body(), headers={"Authorization": "Bearer sekret"})
        models = await client.get("/models")
    assert none.status_code == wrong.status_code == models.status_code == 401
    assert none.json()["error"]["type"] == "authentication_error"
    assert resp.status_code == 200
    assert events[-1] == ("data", "[DONE]")


async def test_bad_requests_get_400() -> None:
    async with served() as (_, client):
        not_json = await client.post("/chat/completions", content=b"{nope")
        bad_mock = await client.post("/chat/completions", json=body(mock={"tokens": "many"}))
    assert not_json.status_code == bad_mock.status_code == 400
    assert "mock.tokens" in bad_mock.json()["error"]["message"]


async def test_midstream_error_chunk() -> None:
    async with served(tokens=10) as (_, client):
        resp, events = await stream(
            client, body(mock={"fault": "midstream_error", "fault_after": 4})
        )
    assert resp.status_code == 200
    assert content(events) == "tok0 tok1 tok2 tok3"
    last = chunks(events)[-1]
    assert set(last["error"]) == {"message", "type", "code"}
    assert last["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}]
    assert ("data", "[DONE]") not in events


async def test_truncate_ends_cleanly_without_finish_or_done() -> None:
    async with served(tokens=10) as (_, client):
        _, events = await stream(client, body(mock={"fault": "truncate", "fault_after": 3}))
    assert content(events) == "tok0 tok1 tok2"
    assert finish_reasons(events) == []
    assert ("data", "[DONE]") not in events


async def test_disconnect_drops_the_connection() -> None:
    async with served(tokens=10) as (app, client):
        with pytest.raises(httpx.RemoteProtocolError):
            await stream(client, body(mock={"fault": "disconnect", "fault_after": 2}))
        assert app.open_streams == 0
        resp, _ = await stream(client, body())  # the server is fine afterwards
    assert resp.status_code == 200


async def test_json_200_and_wrong_content_type() -> None:
    async with served() as (_, client):
        json_200 = await client.post("/chat/completions", json=body(mock={"fault": "json_200"}))
        text = await client.post(
            "/chat/completions", json=body(mock={"fault": "wrong_content_type"})
        )
    assert json_200.status_code == 200
    assert json_200.headers["content-type"] == "application/json"
    assert "error" in json_200.json()
    assert text.status_code == 200
    assert text.headers["content-type"].startswith("text/plain")


async def test_malformed_json_line_then_stream_goes_on() -> None:
    async with served(tokens=4) as (_, client):
        _, events = await stream(client, body(mock={"fault": "malformed_json", "fault_after": 2}))
    broken = []
    for kind, text in events:
        if kind == "data" and text != "[DONE]":
            try:
                json.loads(text)
            except ValueError:
                broken.append(text)
    assert len(broken) == 1
    assert events[-1] == ("data", "[DONE]")


async def test_oversized_event() -> None:
    options = {"fault": "oversized_event", "fault_after": 1, "oversized_mb": 0.25}
    async with served(tokens=3) as (_, client):
        _, events = await stream(client, body(mock=options))
    sizes = sorted(len(text) for kind, text in events if kind == "data")
    assert sizes[-1] > 256 * 1024 > sizes[-2]
    assert events[-1] == ("data", "[DONE]")


async def test_keepalive_comments_interleaved() -> None:
    async with served(tokens=6) as (_, client):
        _, every2 = await stream(client, body(mock={"keepalive_every": 2}))
        _, fault = await stream(client, body(mock={"fault": "keepalive"}))
    assert [kind for kind, _ in every2].count("comment") == 4  # a leading one, then every 2
    assert [kind for kind, _ in fault].count("comment") == 7
    assert content(every2) == content(fault) == expected_reply({}, MockConfig(tokens=6))


# --------------------------------------------------------------------------- timing


async def test_rate_pacing() -> None:
    async with served(tokens=10, rate=100.0) as (_, client):
        started = time.monotonic()
        _, events = await stream(client, body())
        elapsed = time.monotonic() - started
        started = time.monotonic()
        _, ticked = await stream(client, body(mock={"tick": 0.05}))
        ticked_elapsed = time.monotonic() - started
    assert elapsed >= 0.08
    assert ticked_elapsed >= 0.08
    assert content(events) == content(ticked) == expected_reply({}, MockConfig(tokens=10))


async def test_stall_and_first_byte_delays() -> None:
    async with served(tokens=4, stall_seconds=0.2) as (_, client):
        started = time.monotonic()
        _, events = await stream(client, body(mock={"fault": "stall", "stall_after": 2}))
        stalled = time.monotonic() - started
        started = time.monotonic()
        resp = await client.post("/chat/completions", json=body(mock={"fault": "no_first_byte"}))
        first_byte = time.monotonic() - started
    assert stalled >= 0.18
    assert content(events) == "tok0 tok1 tok2 tok3"
    assert first_byte >= 0.18
    assert resp.status_code == 200


async def test_timestamps_and_send_times() -> None:
    async with served(tokens=5, record_send_times=True) as (app, client):
        before = time.time()
        _, events = await stream(client, body(mock={"timestamps": True}))
    stamps = [float(x) for x in content(events).split()]
    assert len(stamps) == 5
    assert all(before <= s <= time.time() for s in stamps)
    assert len(app.send_times) == 5


# --------------------------------------------------------------------------- disconnects


async def test_client_disconnect_is_recorded() -> None:
    async with served(tokens=10, stall_seconds=30.0) as (app, client):
        request = body(mock={"fault": "stall", "fault_after": 2, "key": "job-1"})
        async with client.stream("POST", "/chat/completions", json=request) as resp:
            async for line in resp.aiter_lines():
                if "tok1" in line:
                    break
            assert app.open_streams == 1
            closed_at = time.monotonic()
        await asyncio.wait_for(app.disconnected.wait(), 2.0)
        assert app.open_streams == 0
    [(key, when)] = app.disconnects
    assert key == "job-1"
    assert 0 <= when - closed_at < 1.0


async def test_client_timeout_before_first_byte_is_recorded() -> None:
    async with served(stall_seconds=30.0) as (app, client):
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                "/chat/completions", json=body(mock={"fault": "no_first_byte"}), timeout=0.1
            )
        await asyncio.wait_for(app.disconnected.wait(), 2.0)
    assert len(app.disconnects) == 1


async def test_exit_cuts_running_streams_short() -> None:
    started = time.monotonic()
    app = MockUpstream(MockConfig(stall_seconds=30.0))
    async with serve_mock(app=app) as url, httpx.AsyncClient(base_url=url) as client:
        request = body(mock={"fault": "stall"})
        async with client.stream("POST", "/chat/completions", json=request) as resp:
            async for line in resp.aiter_lines():
                if "tok2" in line:
                    break
            assert app.open_streams == 1
    assert time.monotonic() - started < 3.0
    assert app.open_streams == 0


async def test_serve_mock_with_config_kwargs() -> None:
    async with serve_mock(tokens=2) as url, httpx.AsyncClient(base_url=url) as client:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        _, events = await stream(client, body())
    assert content(events) == "tok0 tok1"
    with pytest.raises(TypeError):
        async with serve_mock(app=MockUpstream(), tokens=2):
            pass
