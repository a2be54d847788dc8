"""The gateway's Responses API over HTTP, in process (real redis-server, worker, mock
upstream, uvicorn on loopback): refusals, ownership, idempotency and limits shared with the
chat endpoint, background responses without a worker, cancel, failures before output,
resets and resuming on another gateway process. The SDK scenarios on real processes are
tests/system/test_gateway_responses.py; the translation itself test_responses_*.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from tests.helpers.gateway_env import KEY, OTHER_KEY, GatewayEnv, collect, running_gateway
from tests.helpers.responses import as_sdk_response, check_stream, sdk_accumulated
from worker.gateway import serve_gateway
from worker.gateway.responses_api import RESPONSE_FIELD
from worker.settings import Settings
from worker.testing.mock_upstream import MockUpstream

RESPONSES = "/v1/responses"
TEXT: dict[str, Any] = {"model": "mock-model", "input": "hello", "mock": {"tokens": 6}}
CHAT: dict[str, Any] = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
ASYNC = {"prefer": "respond-async"}


async def events_of(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(event.data) for event in await collect(response)]
    return events


async def stream(http: httpx.AsyncClient, url: str, **kwargs: Any) -> list[dict[str, Any]]:
    method = "POST" if "json" in kwargs else "GET"
    async with http.stream(method, url, **kwargs) as response:
        return await events_of(response)


async def background(http: httpx.AsyncClient, body: dict[str, Any] = TEXT) -> str:
    response = await http.post(RESPONSES, json={**body, "background": True})
    assert response.status_code == 200, response.text
    response_id: str = response.json()["id"]
    return response_id


async def append(gw: GatewayEnv, response_id: str, kind: str, data: dict[str, Any]) -> None:
    """An entry written straight to the response's job stream, as a worker writes it."""
    key = gw.client.keys.events(response_id.removeprefix("resp_"))
    await gw.redis.xadd(key, {"type": kind, "attempt": "1", "data": json.dumps(data)})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({**TEXT, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({**TEXT, "previous_response_id": "resp_x"}, "previous_response_id"),
        ({**TEXT, "input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({**TEXT, "messages": []}, "messages"),
        ({**TEXT, "stream": "yes"}, "stream"),
    ],
)
async def test_a_request_that_cannot_be_served_is_a_400_naming_the_field(
    gw: GatewayEnv, body: dict[str, Any], param: str
) -> None:
    async with gw.http() as http:
        response = await http.post(RESPONSES, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and param.partition("[")[0] in error["message"]
    assert not await gw.redis.keys(f"{gw.settings.prefix}:job:*")  # no job was made


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [(b"{not json", 400, "invalid_json"), (b"[1]", 400, "invalid_request"),
     (b'{"input": "' + b"x" * 2_000_000 + b'"}', 413, "request_too_large")],
)  # fmt: skip
async def test_a_body_that_is_not_a_request_is_refused(
    gw: GatewayEnv, content: bytes, status: int, code: str
) -> None:
    async with gw.http() as http:
        response = await http.post(RESPONSES, content=content)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code)


async def test_keys_own_their_responses(idle: GatewayEnv) -> None:
    async with idle.http() as mine, idle.http(OTHER_KEY) as theirs, idle.http(None) as nobody:
        response_id = await background(mine)
        job_id = response_id.removeprefix("resp_")
        for url in (f"{RESPONSES}/{response_id}", f"{RESPONSES}/{response_id}?stream=true"):
            answer = await theirs.get(url)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == (
                "response_not_found"
            )
        assert (await theirs.post(f"{RESPONSES}/{response_id}/cancel")).status_code == 404
        assert (await nobody.get(f"{RESPONSES}/{response_id}")).status_code == 401
        for other in ("resp_nope", job_id, "resp_..%2F..", "resp_" + "x" * 300, "msg_" + job_id):
            assert (await mine.get(f"{RESPONSES}/{other}")).status_code == 404, other
        # a chat completion's job is not a response, though the key owns it
        chat = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
        made = await mine.post(
            "/v1/chat/completions", json=chat, headers={"prefer": "respond-async"}
        )
        assert (await mine.get(f"{RESPONSES}/resp_{made.json()['id']}")).status_code == 404
        # ... and a response is a job like any other, for the job endpoints too
        assert (await mine.get(f"/v1/jobs/{job_id}")).json()["status"] == "queued"
        # the other key's cancel changed nothing
        assert (await mine.get(f"{RESPONSES}/{response_id}")).json()["status"] == "queued"


async def test_a_background_response_is_queued_at_once_and_cancelled_while_queued(
    idle: GatewayEnv,
) -> None:
    body = {**TEXT, "metadata": {"ticket": "42"}, "instructions": "Be brief."}
    async with idle.http() as http:
        created = await http.post(RESPONSES, json={**body, "background": True})
        queued = as_sdk_response(created.json())
        assert queued.status == "queued" and queued.background is True and queued.output == []
        assert queued.metadata == {"ticket": "42"} and queued.instructions == "Be brief."
        assert created.headers["x-chatstream-job-id"] == queued.id.removeprefix("resp_")
        retrieved = await http.get(f"{RESPONSES}/{queued.id}")
        assert retrieved.json() == created.json()
        cancelled = await http.post(f"{RESPONSES}/{queued.id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        again = await http.post(f"{RESPONSES}/{queued.id}/cancel")  # cancelling is idempotent
        assert again.json() == cancelled.json()
        events = await stream(http, f"{RESPONSES}/{queued.id}?stream=true")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.incomplete"
    ]  # fmt: skip
    assert as_sdk_response(events[-1]["response"]).status == "cancelled"
    check_stream(events)


async def test_a_finished_response_cannot_be_cancelled(gw: GatewayEnv) -> None:
    async with gw.http() as http:
        done = (await http.post(RESPONSES, json=TEXT)).json()
        assert done["status"] == "completed"
        refused = await http.post(f"{RESPONSES}/{done['id']}/cancel")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "response_ended"


async def test_an_idempotency_key_finds_the_same_response(gw: GatewayEnv) -> None:
    async with gw.http() as http:
        key = {"idempotency-key": "order-7"}
        first = await http.post(RESPONSES, json=TEXT, headers=key)
        events = await stream(http, RESPONSES, json={**TEXT, "stream": True}, headers=key)
        late = await http.post(RESPONSES, json={**TEXT, "background": True}, headers=key)
        changed = await http.post(RESPONSES, json={**TEXT, "metadata": {"a": "b"}}, headers=key)
        other_key = await http.post(RESPONSES, json=TEXT, headers={"idempotency-key": "order-8"})
    assert first.status_code == 200 and events[-1]["response"] == first.json()
    assert late.json() == first.json()  # delivery differs, the response is the same
    assert changed.status_code == 400
    assert changed.json()["error"]["code"] == "idempotency_key_reused"
    assert other_key.json()["id"] != first.json()["id"]


async def test_responses_share_the_keys_job_rate_and_stream_limits(
    settings: Settings, redis: Redis, mock_upstream: tuple[MockUpstream, str]
) -> None:
    async with running_gateway(
        settings, redis, mock_upstream, worker=False, gateway_jobs_per_minute=2,
        gateway_max_streams_per_key=1,
    ) as env, env.http() as http:  # fmt: skip
        made = await http.post("/v1/chat/completions", json=CHAT, headers=ASYNC)
        assert made.status_code == 202
        response_id = await background(http)
        limited = await http.post(RESPONSES, json={**TEXT, "background": True})
        assert limited.status_code == 429 and limited.headers["retry-after"]
        async with http.stream("GET", f"{RESPONSES}/{response_id}?stream=true") as open_one:
            assert open_one.status_code == 200
            second = await http.get(f"{RESPONSES}/{response_id}?stream=true")
        assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_streams"


@pytest.mark.parametrize(
    "query", ["stream=maybe", "stream=true&starting_after=-1", "stream=true&starting_after=x",
              "stream=true&starting_after=%C2%B2", "stream=true&starting_after=1e3"],
)  # fmt: skip
async def test_bad_query_parameters_are_a_400(idle: GatewayEnv, query: str) -> None:
    async with idle.http() as http:
        response_id = await background(http)
        answer = await http.get(f"{RESPONSES}/{response_id}?{query}")
    assert answer.status_code == 400, answer.text


@pytest.mark.parametrize("stream_it", [True, False], ids=["stream", "no-stream"])
async def test_a_failure_before_any_output_is_the_upstreams_http_error(
    gw: GatewayEnv, stream_it: bool
) -> None:
    body = {**TEXT, "mock": {"fault": "http_400"}, "stream": stream_it}
    async with gw.http() as http:
        response = await http.post(RESPONSES, json=body)
        assert response.status_code == 400 and response.headers["x-should-retry"] == "false"
        assert response.json()["error"]["code"] == "upstream_terminal"
        # in the background there is no HTTP answer to give: the stream says it
        events = await stream(http, RESPONSES, json={**body, "stream": True, "background": True})
    failed = as_sdk_response(events[-1]["response"])
    assert failed.status == "failed" and failed.error and failed.error.code == "invalid_prompt"
    assert failed.error.model_extra == {"chatstream": {"code": "upstream_terminal"}}


async def test_the_record_field_is_set_once_and_never_creates_a_record(gw: GatewayEnv) -> None:
    records = gw.client.records
    assert await records.set_once("no-such-job", RESPONSE_FIELD, "x") is None
    assert not await gw.redis.exists(gw.client.keys.job("no-such-job"))
    job_id = await gw.client.enqueue(CHAT)
    assert await records.set_once(job_id, RESPONSE_FIELD, "first") == "first"
    assert await records.set_once(job_id, RESPONSE_FIELD, "second") == "first"


async def test_a_reset_and_a_resume_on_another_process_see_the_same_numbers(
    idle: GatewayEnv,
) -> None:
    other = serve_gateway(idle.settings, idle.redis, host="127.0.0.1", port=0)
    async with (
        other as other_url,
        idle.http() as http,
        httpx.AsyncClient(
            base_url=other_url, headers={"authorization": f"Bearer {KEY}"}, timeout=30
        ) as elsewhere,
    ):
        response_id = await background(http)
        url = f"{RESPONSES}/{response_id}?stream=true"
        async with http.stream("GET", url) as live:
            await append(idle, response_id, "delta", {"content": "first try"})
            await append(idle, response_id, "reset", {"reason": "attempt 2 starts"})
            await append(idle, response_id, "delta", {"content": "second"})
            cut: list[dict[str, Any]] = []
            async for line in live.aiter_lines():
                if line.startswith("data: "):
                    cut.append(json.loads(line[6:]))
                if cut and cut[-1]["type"] == "response.output_text.delta" and len(cut) > 8:
                    break  # the client is cut off inside the second attempt
        last = cut[-1]["sequence_number"]
        rest = asyncio.create_task(stream(elsewhere, f"{url}&starting_after={last}"))
        await asyncio.sleep(0.3)  # the resumed client now follows live
        await append(idle, response_id, "delta", {"content": " wins"})
        await append(idle, response_id, "done", {"finish_reason": "stop", "usage": None})
        resumed = await rest
        replay = await stream(http, url)
    assert cut + resumed == replay  # no gap, no duplicate, the same events from either process
    final = sdk_accumulated(check_stream(replay))
    assert final.output_text == "second wins"
    assert [e["type"] for e in replay].count("response.in_progress") == 2


async def test_a_stream_whose_job_expires_ends_with_an_error_event(idle: GatewayEnv) -> None:
    async with idle.http() as http:
        response_id = await background(http)
        async with http.stream("GET", f"{RESPONSES}/{response_id}?stream=true") as response:
            await idle.redis.delete(idle.client.keys.job(response_id.removeprefix("resp_")))
            events = await events_of(response)
        gone = await http.get(f"{RESPONSES}/{response_id}")
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "job_expired" and events[-1]["sequence_number"] == 2
    assert gone.status_code == 404
