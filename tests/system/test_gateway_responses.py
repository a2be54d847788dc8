"""The Responses API as the official ``openai`` SDK uses it (sync and async clients), against
real processes: two ``chatstream gateway`` processes, a ``chatstream worker`` and
``chatstream mock-upstream`` on the session's redis-server, started once for the module.

Every event the SDK hands out is checked against the SDK's own types
(``openai.types.responses``: validated, no field the SDK does not declare) and accumulated by
the SDK's ``responses.stream()``; replies are compared with what the mock upstream sends.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.checks import eventually
from tests.helpers.gateway_env import KEY, OTHER_KEY, delta, openai_chunk
from tests.helpers.harness import MOCK_PROCESS
from tests.helpers.processes import CHATSTREAM, worker_env
from tests.helpers.responses import check_stream, plain
from tests.helpers.servers import RedisServer, free_port, needs_redis_server
from worker.testing.mock_upstream import (
    expected_reasoning,
    expected_reply,
    expected_tool_calls,
    expected_usage,
)

pytestmark = pytest.mark.xdist_group("responses-processes")  # one deployment per module
TOOLS: list[Any] = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]


@dataclass
class Deployment:
    urls: list[str]  # each gateway process's base URL for the SDK
    processes: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([CHATSTREAM, *args], env=env, cwd=log.parent, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered; {log.read_text()}")


@pytest.fixture(scope="module")
def deployment(
    redis_server: RedisServer | None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    server = needs_redis_server(redis_server)
    directory = tmp_path_factory.mktemp("responses")
    mock_port, ports = free_port(), [free_port(), free_port()]
    upstream = f"http://127.0.0.1:{mock_port}/v1"
    keys = {"gateway_api_keys": f"{KEY},{OTHER_KEY}", "gateway_keepalive_seconds": 1}
    env = worker_env(server.url, f"t-{uuid.uuid4().hex[:12]}", upstream, **keys)
    found = Deployment([f"http://127.0.0.1:{port}/v1" for port in ports])
    try:
        mock_log = directory / "mock.log"
        mock = _spawn(["mock-upstream", "--port", str(mock_port), "--rate", "0"], env, mock_log)
        found.processes.append((mock, mock_log))
        _wait_http(f"http://127.0.0.1:{mock_port}/v1/models", mock, mock_log)
        for name, args in [("worker", ["worker"])] + [
            (f"gateway-{i}", ["gateway", "--host", "127.0.0.1", "--port", str(port)])
            for i, port in enumerate(ports)
        ]:
            found.processes.append((_spawn(args, env, directory / f"{name}.log"),
                                    directory / f"{name}.log"))  # fmt: skip
        for (process, log), url in zip(found.processes[2:], found.urls, strict=True):
            _wait_http(url.removesuffix("/v1") + "/healthz", process, log)
        yield found
    finally:
        _stop(found)


def _stop(found: Deployment) -> None:
    for process, _ in found.processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    codes = [process.wait(15) for process, _ in found.processes]
    for (_, log), code in zip(found.processes[1:], codes[1:], strict=True):  # not the mock
        text = log.read_text()
        assert code == 0 and "Traceback" not in text and KEY not in text, text


class Sdk:
    """The same calls through ``openai.OpenAI`` (in a thread) or ``openai.AsyncOpenAI``."""

    def __init__(self, flavour: str, base_url: str, key: str = KEY) -> None:
        self.flavour, self.base_url, self.key = flavour, base_url, key

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``client.responses.<method>(...)`` (``create``, ``retrieve``, ``cancel``)."""
        return await self._run(lambda responses: getattr(responses, method)(*args, **kwargs))

    async def events(
        self, method: str, *args: Any, take: int | None = None, **kwargs: Any
    ) -> list[Any]:
        """The events of a stream (``create`` or ``retrieve`` with ``stream=True``); with
        ``take``, only that many, then the client closes the connection (cut off)."""

        def sync(responses: Any) -> list[Any]:
            with getattr(responses, method)(*args, stream=True, **kwargs) as stream:
                return _taken(iter(stream), take)

        async def asynchronous(responses: Any) -> list[Any]:
            stream = await getattr(responses, method)(*args, stream=True, **kwargs)
            out: list[Any] = []
            async for event in stream:
                out.append(event)
                if take is not None and len(out) >= take:
                    break
            await stream.close()
            return out

        events: list[Any] = await self._run(sync if self.flavour == "sync" else asynchronous)
        return events

    async def accumulated(self, **kwargs: Any) -> tuple[list[Any], Any]:
        """``responses.stream(...)``: the events it hands out and its final response."""

        def sync(responses: Any) -> tuple[list[Any], Any]:
            with responses.stream(**kwargs) as stream:
                return list(stream), stream.get_final_response()

        async def asynchronous(responses: Any) -> tuple[list[Any], Any]:
            async with responses.stream(**kwargs) as stream:
                return [event async for event in stream], await stream.get_final_response()

        found: tuple[list[Any], Any] = await self._run(
            sync if self.flavour == "sync" else asynchronous
        )
        return found

    async def _run(self, work: Callable[[Any], Any]) -> Any:
        options: Any = {"base_url": self.base_url, "api_key": self.key, "max_retries": 0,
                        "timeout": 60}  # fmt: skip
        if self.flavour == "async":
            async with openai.AsyncOpenAI(**options) as client:
                result = work(client.responses)
                return await result if asyncio.iscoroutine(result) else result

        def in_thread() -> Any:
            with openai.OpenAI(**options) as client:
                return work(client.responses)

        return await asyncio.to_thread(in_thread)


def _taken(events: Iterator[Any], take: int | None) -> list[Any]:
    out: list[Any] = []
    for event in events:
        out.append(event)
        if take is not None and len(out) >= take:
            break
    return out


def as_dicts(events: list[Any]) -> list[dict[str, Any]]:
    return [event.to_dict() for event in events]


def chat_of(text: str, **mock: Any) -> dict[str, Any]:
    """The chat request the mock upstream gets for ``input=text`` (what it answers by)."""
    return {"model": "mock-model", "messages": [{"role": "user", "content": text}], "mock": mock}


def responses_usage(usage: dict[str, int]) -> dict[str, Any]:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip


def outline(response: Any) -> dict[str, Any]:
    """A response without its ids (another response to the same request has the same)."""
    items = [{k: v for k, v in item.items() if k != "id"} for item in plain(response)["output"]]
    return {"status": response.status, "output": items, "usage": plain(response)["usage"]}


FLAVOURS = pytest.mark.parametrize("flavour", ["sync", "async"])


@FLAVOURS
async def test_a_streamed_response_is_the_apis_typed_events(
    deployment: Deployment, flavour: str
) -> None:
    sdk = Sdk(flavour, deployment.urls[0])
    mock = {"tokens": 12, "reasoning": 3, "tool_calls": 2}
    request: Any = {"model": "mock-model", "input": "Tell me", "tools": TOOLS,
               "extra_body": {"mock": mock}}  # fmt: skip
    events = await sdk.events("create", **request)
    parsed = check_stream(as_dicts(events))
    kinds = [event.type for event in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert {"response.reasoning_text.delta", "response.output_text.delta",
            "response.function_call_arguments.delta"} <= set(kinds)  # fmt: skip
    chat = {**chat_of("Tell me", **mock), "tools": [{"type": "function",
            "function": {"name": "lookup"}}]}  # fmt: skip
    final = parsed[-1].response
    reasoning, message, *calls = final.output
    assert [c.text for c in reasoning.content] == [expected_reasoning(chat, MOCK_PROCESS)]
    assert message.content[0].text == final.output_text == expected_reply(chat, MOCK_PROCESS)
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        (call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in expected_tool_calls(chat, MOCK_PROCESS)
    ]
    for call in calls:  # the streamed arguments are the call's
        streamed = [e.delta for e in parsed if getattr(e, "item_id", None) == call.id
                    and e.type == "response.function_call_arguments.delta"]  # fmt: skip
        assert "".join(streamed) == call.arguments
    assert final.usage.to_dict() == responses_usage(expected_usage(chat, MOCK_PROCESS))
    # the SDK's own accumulation agrees, and the stored response replays the same events
    handed, accumulated = await sdk.accumulated(**request)
    assert outline(accumulated) == outline(final)
    assert "response.completed" in [event.type for event in handed]
    assert as_dicts(await sdk.events("retrieve", final.id)) == as_dicts(events)
    assert plain(await sdk.call("retrieve", final.id)) == plain(final)


@FLAVOURS
async def test_a_background_stream_cut_off_resumes_on_another_process(
    deployment: Deployment, flavour: str
) -> None:
    first, second = Sdk(flavour, deployment.urls[0]), Sdk(flavour, deployment.urls[1])
    mock = {"tokens": 40, "rate": 80}
    cut = await first.events("create", model="mock-model", input="Go", background=True,
                             extra_body={"mock": mock}, take=9)  # fmt: skip
    response_id, last = cut[0].response.id, cut[-1].sequence_number
    assert cut[0].response.background is True and last == 8
    rest = await second.events("retrieve", response_id, starting_after=last)
    replay = await first.events("retrieve", response_id)
    assert as_dicts(cut) + as_dicts(rest) == as_dicts(replay)  # no gap, no duplicate
    assert rest[0].sequence_number == last + 1
    check_stream(as_dicts(replay))
    text = "".join(e.delta for e in replay if e.type == "response.output_text.delta")
    assert text == replay[-1].response.output_text == expected_reply(chat_of("Go", **mock),
                                                                      MOCK_PROCESS)  # fmt: skip
    # the SDK's own resume: responses.stream(response_id=..., starting_after=...)
    handed, final = await second.accumulated(response_id=response_id, starting_after=last)
    assert [e.sequence_number for e in handed] == [e.sequence_number for e in rest]
    assert final.output_text == text


@FLAVOURS
async def test_a_background_response_is_polled_until_it_completes(
    deployment: Deployment, flavour: str
) -> None:
    sdk = Sdk(flavour, deployment.urls[0])
    mock = {"tokens": 20, "rate": 100}
    created = await sdk.call("create", model="mock-model", input="Poll", background=True,
                             metadata={"ticket": "7"}, extra_body={"mock": mock})  # fmt: skip
    assert created.status in ("queued", "in_progress") and created.background
    seen = [created.status]
    async with asyncio.timeout(60):
        while seen[-1] in ("queued", "in_progress"):  # each poll on the other process
            await asyncio.sleep(0.05)
            sdk = Sdk(flavour, deployment.urls[len(seen) % 2])
            polled = await sdk.call("retrieve", created.id)
            seen.append(polled.status)
    assert seen[-1] == "completed" and polled.metadata == {"ticket": "7"}
    assert polled.output_text == expected_reply(chat_of("Poll", **mock), MOCK_PROCESS)


@FLAVOURS
async def test_a_non_streamed_response_is_the_final_object(
    deployment: Deployment, flavour: str
) -> None:
    sdk = Sdk(flavour, deployment.urls[1])
    done = await sdk.call("create", model="mock-model", input="Hi there", instructions="Short.",
                          extra_body={"mock": {"tokens": 5}})  # fmt: skip
    messages = [{"role": "system", "content": "Short."}, {"role": "user", "content": "Hi there"}]
    chat = {"model": "mock-model", "mock": {"tokens": 5}, "messages": messages}
    assert done.status == "completed" and done.instructions == "Short."
    assert done.output_text == expected_reply(chat, MOCK_PROCESS)
    assert done.usage and done.usage.to_dict() == responses_usage(
        expected_usage(chat, MOCK_PROCESS)
    )
    cut = await sdk.call("create", model="mock-model", input="Hi", max_output_tokens=3,
                         extra_body={"mock": {"tokens": 5}})  # fmt: skip
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "tok0 tok1 tok2"


ARGS = ['{"query": ', '"durable"}']
CALL_SCRIPT = [
    openai_chunk(delta(0, role="assistant", content=None)),
    openai_chunk(delta(0, tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                                       "function": {"name": "lookup", "arguments": ""}}])),
    openai_chunk(delta(0, tool_calls=[{"index": 0, "function": {"arguments": ARGS[0]}}])),
    openai_chunk(delta(0, tool_calls=[{"index": 0, "function": {"arguments": ARGS[1]}}])),
    openai_chunk(delta(0, "tool_calls")),
    "[DONE]",
]  # fmt: skip


@FLAVOURS
async def test_function_tools_round_trip(deployment: Deployment, flavour: str) -> None:
    sdk = Sdk(flavour, deployment.urls[0])
    script = {"mock": {"script": CALL_SCRIPT}}
    events = await sdk.events("create", model="mock-model", input="Find it", tools=TOOLS,
                              tool_choice="required", extra_body=script)  # fmt: skip
    parsed = check_stream(as_dicts(events))
    [call] = parsed[-1].response.output
    streamed = [e.delta for e in parsed if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in parsed if e.type == "response.function_call_arguments.done"]
    # (entries are coalesced: how many deltas depends on timing, never their sum)
    assert "".join(streamed) == done.arguments == "".join(ARGS) == call.arguments
    assert (call.type, call.call_id, call.name) == ("function_call", "call_a", "lookup")
    # the item as added already names its function (the Agents SDK reads it there)
    [added] = [e.item for e in parsed if e.type == "response.output_item.added"]
    assert (added.type, added.name, added.arguments) == ("function_call", "lookup", "")
    # the next turn passes the call and its output back, as the SDK's docs do
    answer = await sdk.call(
        "create", model="mock-model", tools=TOOLS, extra_body={"mock": {"tokens": 2}},
        input=[{"role": "user", "content": "Find it"}, call,
               {"type": "function_call_output", "call_id": "call_a", "output": "found"}],
    )  # fmt: skip
    assert answer.output_text == "tok0 tok1"
    job = answer.id.removeprefix("resp_")
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}) as http:
        record = (await http.get(f"{deployment.urls[0]}/jobs/{job}")).json()
    assert record["request"]["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "lookup", "arguments": "".join(ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "found"},
    ]  # fmt: skip


@FLAVOURS
async def test_a_midstream_error_is_response_failed_not_an_exception(
    deployment: Deployment, flavour: str
) -> None:
    sdk = Sdk(flavour, deployment.urls[1])
    mock = {"tokens": 8, "fault": "midstream_error", "fault_after": 3}
    events = await sdk.events("create", model="mock-model", input="x", extra_body={"mock": mock})
    parsed = check_stream(as_dicts(events))
    failed = parsed[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error"
    assert failed.response.error.model_extra == {"chatstream": {"code": "upstream_stream_error"}}
    assert failed.response.output_text == "tok0 tok1 tok2"
    with pytest.raises(openai.APIStatusError) as caught:  # without a stream: an HTTP error
        await sdk.call("create", model="mock-model", input="x", extra_body={"mock": mock})
    assert caught.value.status_code == 502 and "mid-stream" in caught.value.message


@FLAVOURS
async def test_cancelling_ends_the_stream_and_the_response_is_cancelled(
    deployment: Deployment, flavour: str
) -> None:
    sdk = Sdk(flavour, deployment.urls[0])
    created = await sdk.call("create", model="mock-model", input="Long", background=True,
                             extra_body={"mock": {"tokens": 2000, "rate": 50}})  # fmt: skip
    watching = asyncio.create_task(Sdk(flavour, deployment.urls[1]).events("retrieve", created.id))

    async def started() -> bool:
        return bool((await sdk.call("retrieve", created.id)).output_text)

    await eventually(started, timeout=30, every=0.05)
    cancelled = await sdk.call("cancel", created.id)
    assert cancelled.status == "cancelled"
    async with asyncio.timeout(30):
        events = await watching
    parsed = check_stream(as_dicts(events))
    assert parsed[-1].type == "response.incomplete" and parsed[-1].response.status == "cancelled"
    text = parsed[-1].response.output_text
    assert text and expected_reply(chat_of("Long", tokens=2000), MOCK_PROCESS).startswith(text)
    assert (await sdk.call("retrieve", created.id)).status == "cancelled"


@FLAVOURS
async def test_another_key_finds_no_response(deployment: Deployment, flavour: str) -> None:
    done = await Sdk(flavour, deployment.urls[0]).call(
        "create", model="mock-model", input="mine", extra_body={"mock": {"tokens": 2}}
    )
    other = Sdk(flavour, deployment.urls[1], OTHER_KEY)
    for attempt in (other.call("retrieve", done.id), other.call("cancel", done.id),
                    other.events("retrieve", done.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            await attempt


@FLAVOURS
async def test_the_chat_endpoint_is_unchanged(deployment: Deployment, flavour: str) -> None:
    def chat(stream: bool) -> str:
        with openai.OpenAI(base_url=deployment.urls[1], api_key=KEY, max_retries=0) as client:
            kwargs: Any = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                           "extra_body": {"mock": {"tokens": 4}}}  # fmt: skip
            if not stream:
                return client.chat.completions.create(**kwargs).choices[0].message.content or ""
            chunks = client.chat.completions.create(**kwargs, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async def async_chat(stream: bool) -> str:
        async with openai.AsyncOpenAI(base_url=deployment.urls[1], api_key=KEY) as client:
            kwargs: Any = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                           "extra_body": {"mock": {"tokens": 4}}}  # fmt: skip
            if not stream:
                completion = await client.chat.completions.create(**kwargs)
                return completion.choices[0].message.content or ""
            chunks = await client.chat.completions.create(**kwargs, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    for stream in (True, False):
        text = await (async_chat(stream) if flavour == "async" else asyncio.to_thread(chat, stream))
        assert text == expected_reply(chat_of("hi", tokens=4), MOCK_PROCESS)
