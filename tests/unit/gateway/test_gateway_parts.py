"""The gateway's parts on their own: the OpenAI mapping (pure), API keys, stream slots, the
SSE response, and the hub that fans job streams out (against a real redis-server)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import AsyncGenerator, AsyncIterator, MutableMapping
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from redis.asyncio import Redis

from schemas.events import StreamEvent
from schemas.jobs import EXTRAS, JobRecord
from tests.helpers.checks import Merged, eventually, final_tool_calls, merge_deltas
from tests.helpers.gateway_env import parse_frames
from tests.unit.gateway.test_gateway_openai import Reply, StreamReader
from worker.aio import cancel_and_wait
from worker.errors import ConfigError
from worker.gateway import openai_format as fmt
from worker.gateway.auth import ApiKeys, bearer
from worker.gateway.hub import ClientTooSlow, EventHub, JobFeed, ReadCommand, Row, rows_size
from worker.gateway.limits import LimitExceeded, StreamSlots
from worker.gateway.streaming import EventStream
from worker.protocol.message import Delta
from worker.store.keys import Keys

CTX = fmt.ChunkContext("job-1", 1751299200, "some/model", include_usage=True)
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def row(entry_id: str, kind: str, data: dict[str, Any], attempt: int = 1) -> Row:
    return entry_id, {"type": kind, "attempt": str(attempt), "data": json.dumps(data)}


def payloads(kind: str, data: dict[str, Any], ctx: fmt.ChunkContext = CTX) -> list[Any]:
    return fmt.entry_payloads(ctx, kind, data)


def envelope(choices: list[Any], **top: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-job-1",
        "object": "chat.completion.chunk",
        "created": 1751299200,
        "model": "some/model",
        "choices": choices,
        **top,
    }


# -- the OpenAI mapping ------------------------------------------------------------------


def test_a_delta_entry_is_one_chunk_and_each_field_maps() -> None:
    data = {
        "role": "assistant",
        "content": "Hi",
        "refusal": "I can't",
        "reasoning_details": [{"type": "reasoning.text", "text": "so", "index": 0}],
        "tool_calls": [
            {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}},
            {"index": 1, "function": {"arguments": "{}"}},
        ],
    }
    delta = {
        **data,
        "tool_calls": [
            {
                "index": 0,
                "id": "c1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            },
            {"index": 1, "function": {"arguments": "{}"}},
        ],
    }
    assert payloads("delta", data) == [
        envelope([{"index": 0, "delta": delta, "finish_reason": None}])
    ]


def test_delta_keys_without_a_mapping_pass_through() -> None:
    chunk = payloads("delta", {"annotations": [1], "choices": [{"index": 1, "audio": {}}]})[0]
    assert chunk["choices"] == [
        {"index": 0, "delta": {"annotations": [1]}, "finish_reason": None},
        {"index": 1, "delta": {"audio": {}}, "finish_reason": None},
    ]


def _open(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": None}


def test_the_other_choices_of_a_delta_entry_are_in_the_same_chunk_by_index() -> None:
    """n > 1: one chunk per entry (OpenAI's ``choices`` may hold several), so the entry's
    id resumes after all of it; each choice's fields map as choice 0's do."""
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}
    data = {
        "content": "A",
        "choices": [
            {"index": 1, "role": "assistant", "refusal": "no"},
            {"index": 2, "tool_calls": [call]},
        ],
    }
    announced = {**call, "function": {"name": "f", "arguments": ""}}
    assert payloads("delta", data) == [
        envelope(
            [
                {"index": 0, "delta": {"content": "A"}, "finish_reason": None},
                {
                    "index": 1,
                    "delta": {"role": "assistant", "refusal": "no"},
                    "finish_reason": None,
                },
                {"index": 2, "delta": {"tool_calls": [announced]}, "finish_reason": None},
            ]
        )
    ]
    only_others = payloads("delta", {"choices": [{"index": 2, "content": "B"}]})[0]
    assert only_others["choices"] == [
        {"index": 2, "delta": {"content": "B"}, "finish_reason": None}
    ]
    frames = fmt.sse_frames(CTX, [row("5-0", "delta", data)])
    assert [e.id for e in parse_frames(frames)] == ["5-0"]


def test_the_done_entry_is_the_finish_chunk_then_usage_when_asked() -> None:
    data = {"finish_reason": "stop", "usage": USAGE, "web_search": {"q": 1}, "free_tier": None}
    finish = envelope([{"index": 0, "delta": {}, "finish_reason": "stop"}], web_search={"q": 1})
    assert payloads("done", data) == [finish, envelope([], usage=USAGE)]
    without = fmt.ChunkContext("job-1", 1751299200, "some/model", include_usage=False)
    assert payloads("done", data, without) == [finish]
    assert len(payloads("done", {"finish_reason": "stop", "usage": None})) == 1
    frames = fmt.sse_frames(CTX, [row("5-0", "done", data)])
    assert frames.endswith(b"data: [DONE]\n\n") and frames.count(b"id: ") == 1


def test_the_finish_chunk_has_every_choices_finish_reason_and_the_extras() -> None:
    data = {
        "finish_reason": "stop",
        "usage": USAGE,
        "free_tier": False,  # a value, not an absence
        "choices": [{"index": 1, "finish_reason": "length"}, {"index": 2, "finish_reason": None}],
    }
    finish, usage = payloads("done", data)
    assert finish == envelope(
        [
            {"index": 0, "delta": {}, "finish_reason": "stop"},
            {"index": 1, "delta": {}, "finish_reason": "length"},
            {"index": 2, "delta": {}, "finish_reason": None},
        ],
        free_tier=False,
    )
    assert usage == envelope([], usage=USAGE)


def test_error_and_cancelled_entries_are_openai_error_chunks() -> None:
    error = {"code": "upstream_stream_error", "message": "boom", "status": 502}
    [failed] = payloads("error", {"error": error, "finish_reason": "error", "usage": USAGE})
    assert failed == envelope(
        [{"index": 0, "delta": {}, "finish_reason": "error"}],
        error={"message": "boom", "type": "upstream_error", "param": None, "code": error["code"]},
        usage=USAGE,
    )
    [cancelled] = payloads("cancelled", {})
    assert cancelled["error"]["code"] == "cancelled"
    assert b"[DONE]" not in fmt.sse_frames(CTX, [row("5-0", "error", {"error": error})])


def test_an_error_entry_ends_every_choice_and_keeps_the_extras() -> None:
    data = {
        "error": {"code": "truncated", "message": "cut"},
        "finish_reason": None,
        "usage": None,
        "web_search": {"results": 2},
        "choices": [{"index": 1, "finish_reason": "stop"}],
    }
    [failed] = payloads("error", data)
    assert [(c["index"], c["finish_reason"]) for c in failed["choices"]] == [
        (0, "error"),
        (1, "error"),
    ]
    assert failed["web_search"] == {"results": 2} and failed["error"]["code"] == "truncated"
    assert "usage" not in failed
    [cancelled] = payloads("cancelled", {"usage": USAGE, "free_tier": {"left": 0}})
    assert cancelled["free_tier"] == {"left": 0} and cancelled["usage"] == USAGE


def test_a_reset_is_announced_in_an_extension_field() -> None:
    data = {"reason": "attempt 2 starts; earlier deltas are void"}
    assert payloads("reset", data) == [envelope([], chatstream={"reset": data})]


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ({"code": "upstream_terminal", "status": 400}, 400),
        ({"code": "upstream_terminal", "status": 404}, 404),
        ({"code": "upstream_terminal", "status": 401}, 502),  # our upstream key, not theirs
        ({"code": "upstream_retryable", "status": 503}, 502),
        ({"code": "upstream_timeout"}, 504),
        ({"code": "invalid_job"}, 400),
        ({"code": "cancelled"}, 409),
        ({"code": "attempts_exhausted"}, 502),
    ],
)
def test_a_failed_job_maps_to_an_http_status(error: dict[str, Any], status: int) -> None:
    assert fmt.job_error_status(error)[0] == status


def test_a_record_becomes_a_chat_completion() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    record = JobRecord.model_validate(
        {"id": "job-1", "status": "succeeded", "tool_calls": calls, "finish_reason": "tool_calls",
         "usage": USAGE, "model": "upstream/model", "free_tier": {"left": 3}}
    )  # fmt: skip
    body = fmt.completion(CTX, record)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls},
            "finish_reason": "tool_calls",
        }
    ]
    assert body["model"] == "upstream/model" and body["free_tier"] == {"left": 3}
    assert body["usage"] == USAGE and body["object"] == "chat.completion"
    assert "web_search" not in body


def test_a_record_with_other_choices_and_a_refusal_becomes_every_choice() -> None:
    reasoning = [{"type": "reasoning.text", "text": "hm", "index": 0}]
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    other = {"role": "assistant", "content": "", "refusal": "", "reasoning": [], "tool_calls": []}
    record = JobRecord.model_validate(
        {"id": "job-1", "status": "succeeded", "content": "", "refusal": "I can't",
         "finish_reason": "stop", "web_search": {"results": 0},
         "choices": [
             {**other, "index": 1, "content": "Sure", "reasoning": reasoning,
              "finish_reason": "length"},
             {**other, "index": 2, "tool_calls": calls, "finish_reason": "tool_calls"},
             {**other, "index": 3, "finish_reason": "stop"},
         ]}
    )  # fmt: skip
    body = fmt.completion(CTX, record)
    assert [(c["index"], c["finish_reason"], c["message"]) for c in body["choices"]] == [
        (0, "stop", {"role": "assistant", "content": None, "refusal": "I can't"}),
        (1, "length", {"role": "assistant", "content": "Sure", "refusal": None,
                       "reasoning_details": reasoning}),
        (2, "tool_calls", {"role": "assistant", "content": None, "refusal": None,
                           "tool_calls": calls}),
        (3, "stop", {"role": "assistant", "content": "", "refusal": None}),
    ]  # fmt: skip
    assert body["web_search"] == {"results": 0} and "free_tier" not in body


def test_native_frames_are_the_decoded_entries() -> None:
    rows = [row("1-0", "delta", {"content": 'é\n"x"'}), row("2-0", "done", {"usage": None})]
    events = parse_frames(fmt.native_frames(rows))
    expected = [StreamEvent.from_entry(i, f).model_dump(mode="json") for i, f in rows]
    assert [json.loads(e.data) for e in events] == expected
    assert [e.id for e in events] == ["1-0", "2-0"]


TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=6)
EXTRA_VALUES = st.one_of(st.none(), st.just(False), st.dictionaries(st.sampled_from("ab"), TEXT))


class _Choice:
    """What a generated stream has sent of one choice so far."""

    def __init__(self) -> None:
        self.calls = 0  # calls started

    def fields(self, draw: st.DrawFn, first: bool) -> dict[str, Any]:
        """The choice's keys of one delta entry (role on its first; the rest drawn)."""
        data: dict[str, Any] = {"role": "assistant"} if first else {}
        for key in ("content", "refusal"):
            if draw(st.booleans()):
                data[key] = draw(TEXT)
        fragments = []
        for index in draw(st.lists(st.integers(0, 2), max_size=2, unique=True)):
            if index > self.calls:
                continue
            fragment: dict[str, Any] = {"index": index}
            if index == self.calls:
                self.calls += 1
                fragment |= {"id": f"call_{index}", "type": "function"}
                fragment["function"] = {"name": f"tool_{index}"}
            if draw(st.booleans()):
                fragment.setdefault("function", {})["arguments"] = draw(TEXT)
            if len(fragment) > 1:  # the worker drops fragments that carry nothing
                fragments.append(fragment)
        if fragments:
            data["tool_calls"] = fragments
        return data


@st.composite
def delta_entries(draw: st.DrawFn) -> list[Row]:
    """A job's delta entries as a worker writes them (any coalescing), then ``done``, for
    n = 1 to 3. Choice k first appears once choice k - 1 has, and a choice's calls start
    in index order, as providers send them (the SDK places choices and calls by position)."""
    choices = [_Choice() for _ in range(draw(st.integers(1, 3)))]
    seen, rows = 0, []
    for i in range(draw(st.integers(1, 10))):
        data: dict[str, Any] = {}
        for index in sorted(draw(st.sets(st.integers(0, len(choices) - 1), min_size=1))):
            if index > seen:
                break
            first = index == seen
            fields = choices[index].fields(draw, first)
            if first:
                seen += 1
            if index == 0:
                data.update(fields)
            elif fields:
                data.setdefault("choices", []).append({"index": index, **fields})
        if data:  # the worker publishes no empty delta
            rows.append(row(f"{i + 1}-0", "delta", data))
    reasons = st.sampled_from(["stop", "tool_calls", "length", "content_filter"])
    done: dict[str, Any] = {
        "finish_reason": draw(reasons),
        "usage": draw(st.none() | st.just(USAGE)),
    }
    done |= {name: draw(EXTRA_VALUES) for name in EXTRAS}
    if seen > 1:
        done["choices"] = [{"index": i, "finish_reason": draw(reasons)} for i in range(1, seen)]
    rows.append(row("99-0", "done", done))
    return rows


def sdk_read(body: bytes) -> Reply:
    """The official SDK's ``stream=True`` over ``body``: its accumulation of the chunks and
    the extras they carried."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    reader = StreamReader()
    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    with openai.OpenAI(
        api_key="sk-test", base_url="http://gateway.test/v1", http_client=http, max_retries=0
    ) as client:
        for chunk in client.chat.completions.create(
            model="some/model", messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            reader.add(chunk)
    return reader.reply()


def merged_reply(rows: list[Row]) -> Reply:
    """What the entries merge to (``Delta.merge``) and the terminal entry says, in the
    shape of ``tests.test_gateway_openai.summary``."""
    merged = merge_deltas([StreamEvent.from_entry(i, f) for i, f in rows])
    done = json.loads(rows[-1][1]["data"])
    outputs = [merged, *(Merged(Delta(other)) for other in merged.data.get("choices", []))]
    reasons = [done["finish_reason"], *(c["finish_reason"] for c in done.get("choices", []))]
    return {
        "choices": [
            {
                "index": index,
                "role": output.role,
                "content": output.content,
                "refusal": output.refusal,
                "tool_calls": [
                    (c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
                    for c in final_tool_calls(output)
                ],
                "finish_reason": reason,
            }
            for index, (output, reason) in enumerate(zip(outputs, reasons, strict=True))
        ],
        "usage": done["usage"],
        "extras": {name: done[name] for name in EXTRAS if done.get(name) is not None},
    }


@settings(max_examples=150, deadline=None)
@given(delta_entries())
def test_the_sdk_rebuilds_what_the_entries_merge_to(rows: list[Row]) -> None:
    """The official SDK's stream accumulation over our frames equals our own merge: every
    choice's role, content, refusal, tool calls and finish_reason, the usage, and the
    extras the SDK's chunks carry."""
    assert sdk_read(fmt.sse_frames(CTX, rows)) == merged_reply(rows)


WAITING = {
    "reason": "upstream_down",
    "upstream": "default",
    "since_ms": 1751299200000,
    "for_s": 12.0,
    "retry_in_s": 4.0,
    "detail": "connection refused by 127.0.0.1:9 (nothing listens there)",
}


@settings(max_examples=60, deadline=None)
@given(delta_entries(), st.sets(st.integers(0, 12)))
def test_waiting_entries_are_comments_the_sdk_and_event_sources_skip(
    rows: list[Row], at: set[int]
) -> None:
    """Waiting entries anywhere before the terminal one: the SDK reads the same reply, an
    SSE reader sees the same events, and each is a ``: waiting {...}`` comment line."""
    waiting = list(rows[:-1])
    for n, index in enumerate(sorted(at, reverse=True)):
        waiting.insert(min(index, len(waiting)), row(f"9-{n}", "waiting", WAITING))
    frames = fmt.sse_frames(CTX, waiting)
    frames += fmt.sse_frames(CTX, [rows[-1]])
    assert sdk_read(frames) == merged_reply(rows)
    plain = fmt.sse_frames(CTX, rows)
    assert [(e.data, e.id) for e in parse_frames(frames)] == [
        (e.data, e.id) for e in parse_frames(plain)
    ]
    assert frames.count(b"\n: waiting {") + frames.startswith(b": waiting {") == len(at)


def test_a_failure_after_waiting_is_still_a_failure_before_output() -> None:
    from worker.gateway.core import failed_before_output

    error = {"error": {"code": "upstream_timeout", "message": "job exceeded 900s"}}
    rows = [
        row("1-0", "waiting", WAITING),
        row("2-0", "waiting", WAITING),
        row("3-0", "error", error),
    ]
    assert failed_before_output(rows)
    assert not failed_before_output([row("1-0", "delta", {"content": "x"}), rows[-1]])


# -- API keys and slots ------------------------------------------------------------------


def test_api_keys_plain_or_hashed_are_one_and_the_same_key() -> None:
    digest = hashlib.sha256(b"sk-two").hexdigest()
    keys = ApiKeys.from_setting(SecretStr(f" sk-one , sha256:{digest.upper()},"))
    plain = ApiKeys.from_setting(SecretStr("sk-two"))
    one, two = keys.keys
    assert keys.check("sk-one") == one and keys.check("sk-two") == two
    assert keys.check("sk-one ") is None and keys.check("") is None
    assert two.id == plain.keys[0].id and two.id.startswith("k") and "sk-two" not in two.id
    token = two.events_token("job-1")
    assert keys.check_token(two.id, "job-1", token) == two
    assert keys.check_token(two.id, "job-2", token) is None
    assert keys.check_token(one.id, "job-1", token) is None
    assert keys.check_token(two.id, "job-1", "ünïcode") is None


@pytest.mark.parametrize("value", [None, SecretStr(""), SecretStr(" , ")])
def test_no_api_keys_is_a_config_error(value: SecretStr | None) -> None:
    with pytest.raises(ConfigError, match="needs API keys"):
        ApiKeys.from_setting(value)


def test_bearer_tokens() -> None:
    assert bearer("Bearer abc") == "abc" and bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") == "" and bearer(None) is None


def test_stream_slots_per_key_and_in_all() -> None:
    slots = StreamSlots(per_key=2, total=3)
    slots.acquire("a")
    with slots.hold("a"):
        with pytest.raises(LimitExceeded) as per_key:
            slots.acquire("a")
        slots.acquire("b")
        with pytest.raises(LimitExceeded) as total:
            slots.acquire("c")
    assert (per_key.value.status, total.value.status) == (429, 503)
    assert slots.open == {"a": 1, "b": 1} and slots.open_total == 2
    with pytest.raises(RuntimeError), slots.hold("c"):
        raise RuntimeError
    assert slots.open_total == 2


# -- the SSE response --------------------------------------------------------------------


class Recorder:
    def __init__(self, *, block_after: int | None = None) -> None:
        self.sent: list[MutableMapping[str, Any]] = []
        self.block_after = block_after
        self.closed: list[bool] = []
        self.source_closed = False

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.block_after is not None and len(self.sent) > self.block_after:
            await asyncio.Event().wait()  # a client that takes no more bytes
        self.sent.append(message)

    async def on_close(self, gone: bool) -> None:
        self.closed.append(gone)

    async def frames(self, count: int | None) -> AsyncGenerator[bytes, None]:
        try:
            i = 0
            while count is None or i < count:
                yield f"data: {i}\n\n".encode()
                i += 1
                await asyncio.sleep(0.001)
        finally:
            self.source_closed = True


async def never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError


async def test_an_event_stream_writes_every_frame_then_ends() -> None:
    rec = Recorder()
    stream = EventStream(rec.frames(3), headers={"x-a": "1"}, send_timeout=5, on_close=rec.on_close)
    await stream({}, never, rec.send)
    assert rec.sent[0]["status"] == 200 and (b"x-a", b"1") in rec.sent[0]["headers"]
    assert [m.get("body") for m in rec.sent[1:]] == [
        b"data: 0\n\n",
        b"data: 1\n\n",
        b"data: 2\n\n",
        b"",
    ]
    assert rec.sent[-1]["more_body"] is False
    assert rec.closed == [False] and rec.source_closed


async def test_an_event_stream_stops_when_the_client_goes() -> None:
    rec = Recorder()

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    stream = EventStream(rec.frames(None), headers={}, send_timeout=5, on_close=rec.on_close)
    async with asyncio.timeout(5):
        await stream({}, receive, rec.send)
    assert rec.closed == [True] and rec.source_closed


async def test_an_event_stream_drops_a_client_that_takes_no_bytes() -> None:
    rec = Recorder(block_after=3)
    stream = EventStream(rec.frames(None), headers={}, send_timeout=0.2, on_close=rec.on_close)
    async with asyncio.timeout(5):
        await stream({}, never, rec.send)
    assert rec.closed == [True] and rec.source_closed and len(rec.sent) == 4


# -- the hub -----------------------------------------------------------------------------


async def written(redis: Redis, key: str, count: int, seed: int) -> list[Row]:
    """``count`` delta entries at random small intervals, then a done entry."""
    rnd = random.Random(seed)
    for i in range(count):
        await redis.xadd(
            key, {"type": "delta", "attempt": "1", "data": json.dumps({"content": str(i)})}
        )
        if rnd.random() < 0.3:
            await asyncio.sleep(rnd.random() * 0.004)
    await redis.xadd(key, {"type": "done", "attempt": "1", "data": "{}"})
    rows: Any = await redis.xrange(key)
    return [(entry_id, dict(fields)) for entry_id, fields in rows]


async def read_all(feed: JobFeed) -> list[Row]:
    got: list[Row] = []
    async for rows in feed.batches():
        got.extend(rows)
    return got


@pytest.fixture
async def hub(redis: Redis, prefix: str) -> AsyncIterator[EventHub]:
    hub = EventHub(redis, Keys(prefix), max_backlog=4)  # tiny: clients overflow and catch up
    task = asyncio.create_task(hub.run())
    yield hub
    await cancel_and_wait([task])
    await hub.close()


@pytest.mark.parametrize("seed", range(3))
async def test_feeds_get_exactly_the_entries_after_their_cursor(
    redis: Redis, prefix: str, hub: EventHub, seed: int
) -> None:
    """Clients that join at random moments, from random cursors, while entries are written
    (history, live, gaps, overflows and catch-ups all happen): each gets every entry after
    its cursor exactly once, in order, up to the terminal one."""
    keys, rnd = Keys(prefix), random.Random(seed)
    jobs = [f"job-{i}" for i in range(3)]

    async def client(job_id: str) -> tuple[str, list[Row]]:
        await asyncio.sleep(rnd.random() * 0.3)
        existing: Any = await redis.xrange(keys.events(job_id))
        # (not the terminal entry: after it, only a feed told the job ended returns)
        cursor = rnd.choice(["0-0", *(eid for eid, f in existing if f["type"] != "done")])
        feed = JobFeed(hub, keys, job_id, after=cursor, idle_seconds=5, drop_when_behind=False)
        return cursor, await read_all(feed)

    picks = [rnd.choice(jobs) for _ in range(30)]
    clients = [asyncio.create_task(client(job_id)) for job_id in picks]
    writers = [written(redis, keys.events(job_id), 300, seed + i) for i, job_id in enumerate(jobs)]
    streams = dict(zip(jobs, await asyncio.gather(*writers), strict=True))
    async with asyncio.timeout(30):
        results = await asyncio.gather(*clients)
    for job_id, (cursor, got) in zip(picks, results, strict=True):
        ids = [entry_id for entry_id, _ in streams[job_id]]
        start = 0 if cursor == "0-0" else ids.index(cursor) + 1
        assert got == streams[job_id][start:], (job_id, cursor)
    assert hub.followed == 0


async def test_a_newly_followed_job_wakes_the_blocked_read(redis: Redis, prefix: str) -> None:
    keys = Keys(prefix)
    hub = EventHub(redis, keys, block_ms=60_000)  # without a wake-up, a minute
    task = asyncio.create_task(hub.run())
    try:
        first = asyncio.create_task(read_all(JobFeed(hub, keys, "a", idle_seconds=90)))
        await asyncio.sleep(0.2)  # the hub now blocks in XREAD on job a alone
        second = asyncio.create_task(read_all(JobFeed(hub, keys, "b", idle_seconds=90)))
        await asyncio.sleep(0.2)
        await redis.xadd(keys.events("b"), {"type": "done", "attempt": "1", "data": "{}"})
        async with asyncio.timeout(5):
            assert [fields["type"] for _, fields in await second] == ["done"]
    finally:
        await cancel_and_wait([task])
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await hub.close()
    assert not await redis.exists(hub.wake_key)


async def test_a_feed_of_a_finished_job_reads_history_only(
    redis: Redis, prefix: str, hub: EventHub
) -> None:
    keys = Keys(prefix)
    stream = await written(redis, keys.events("j"), 5, 0)
    assert await read_all(JobFeed(hub, keys, "j", ended=True)) == stream
    assert await read_all(JobFeed(hub, keys, "j", after=stream[-1][0], ended=True)) == []
    assert await read_all(JobFeed(hub, keys, "j", after=stream[2][0], ended=True)) == stream[3:]


async def add(redis: Redis, key: str, kind: str = "delta", text: str = "x") -> str:
    data = json.dumps({"content": text}) if kind == "delta" else "{}"
    entry_id: Any = await redis.xadd(key, {"type": kind, "attempt": "1", "data": data})
    return str(entry_id)


async def test_a_follower_behind_the_hub_reads_the_gap_itself(
    redis: Redis, prefix: str, hub: EventHub
) -> None:
    """The hub already read the job further than a new client's cursor: the client gets
    the entries in between from XRANGE, then the hub's, each once."""
    keys = Keys(prefix)
    key = keys.events("j")
    ahead = JobFeed(hub, keys, "j", idle_seconds=5)
    ahead_rows = ahead.batches()
    ids: list[str] = [await add(redis, key, text=str(i)) for i in range(3)]
    got_ahead = await anext(ahead_rows)  # history: hub not involved yet
    assert [r[0] for r in got_ahead] == ids
    ids += [await add(redis, key, text=str(i)) for i in range(3, 6)]
    while len(got_ahead) < 6:
        got_ahead += await anext(ahead_rows)  # now the hub has read through ids[5]
    behind = JobFeed(hub, keys, "j", after=ids[1], idle_seconds=5)
    follower = hub.follow(key, ids[1])  # what behind.batches() does once its history ends
    assert follower.gap_end == ids[5]
    live = behind._live(follower)
    ids.append(await add(redis, key, "done"))
    got: list[Row] = []
    async for rows in live:
        got += rows
        if got and got[-1][0] == ids[-1]:
            break
    hub.unfollow(follower)
    assert [r[0] for r in got] == ids[2:]
    await ahead_rows.aclose()


async def test_a_client_that_falls_behind_is_dropped_and_catches_up(
    redis: Redis, prefix: str, hub: EventHub
) -> None:
    """More entries than max_backlog (4) arrive while the client is not reading: the hub
    stops buffering for it, and (a feed asked to catch up: the gateway's own wait for a
    job's end) it reads the rest from Redis, without loss or repeat."""
    keys = Keys(prefix)
    key = keys.events("j")
    await redis.hset(keys.job("j"), "status", "running")  # idle feeds check the record
    feed = JobFeed(hub, keys, "j", idle_seconds=0.1, drop_when_behind=False)
    rows = feed.batches()
    assert await anext(rows) == []  # following live, idle
    assert hub.followed == 1
    ids = [await add(redis, key, text=str(i)) for i in range(10)]
    ids.append(await add(redis, key, "done"))
    await eventually_async(lambda: hub.followed == 0)  # overflowed: dropped by the hub
    got: list[Row] = []
    async for batch in rows:
        got += batch
    assert [r[0] for r in got] == ids


@pytest.fixture
async def small_hub(redis: Redis, prefix: str) -> AsyncIterator[EventHub]:
    hub = EventHub(redis, Keys(prefix), max_bytes=16_384)  # four 4 KB entries
    task = asyncio.create_task(hub.run())
    yield hub
    await cancel_and_wait([task])
    await hub.close()


async def test_a_client_that_does_not_read_is_dropped_past_its_byte_bound(
    redis: Redis, prefix: str, small_hub: EventHub
) -> None:
    keys = Keys(prefix)
    await redis.hset(keys.job("j"), "status", "running")
    rows = JobFeed(small_hub, keys, "j", idle_seconds=0.1).batches()
    assert await anext(rows) == []  # following live
    first = await add(redis, keys.events("j"), text="a" * 4000)
    assert [row[0] for row in await anext(rows)] == [first]  # taken: now being sent
    for _ in range(6):  # ... and the client takes nothing more while 24 KB arrive
        await add(redis, keys.events("j"), text="b" * 4000)
        await asyncio.sleep(0.02)  # one hub read each
    await eventually_async(lambda: small_hub.followed == 0)  # the hub let it go
    with pytest.raises(ClientTooSlow) as dropped:
        await anext(rows)
    assert dropped.value.waiting > 16_384
    await rows.aclose()


async def test_a_client_that_reads_is_not_dropped_by_one_large_read(
    redis: Redis, prefix: str, small_hub: EventHub
) -> None:
    keys = Keys(prefix)
    key = keys.events("j")
    await redis.hset(keys.job("j"), "status", "running")
    rows = JobFeed(small_hub, keys, "j", idle_seconds=0.1).batches()
    assert await anext(rows) == []
    reading = asyncio.create_task(read_rest(rows))
    await asyncio.sleep(0.05)  # the client waits for entries
    await add(redis, key, text="c" * 80_000)  # one entry, one hub read: 80 KB
    await add(redis, key, "done")
    got = await reading
    assert [len(row[1]["data"]) for row in got] == [len(json.dumps({"content": "c" * 80_000})), 2]


async def test_a_reading_client_gets_a_read_larger_than_its_bound_in_pages(
    redis: Redis, prefix: str, small_hub: EventHub
) -> None:
    """Ten 4 KB entries in one hub read (one transaction) for a client with nothing
    waiting: it gets the first within its 16 KB, the rest from Redis, in order, undropped."""
    keys = Keys(prefix)
    key = keys.events("j")
    await redis.hset(keys.job("j"), "status", "running")
    rows = JobFeed(small_hub, keys, "j", idle_seconds=0.1).batches()
    reading = asyncio.create_task(read_rest(rows))
    await eventually_async(lambda: small_hub.followed == 1)
    async with redis.pipeline(transaction=True) as pipe:
        for i in range(10):
            pipe.xadd(key, {"type": "delta", "attempt": "1", "data": f"{i:04d}" + "e" * 4000})
        pipe.xadd(key, {"type": "done", "attempt": "1", "data": "{}"})
        await pipe.execute()
    got = await reading
    assert [row[1]["data"][:4] for row in got[:-1]] == [f"{i:04d}" for i in range(10)]
    assert got[-1][1]["type"] == "done"


async def read_rest(rows: AsyncGenerator[list[Row], None]) -> list[Row]:
    got: list[Row] = []
    async for batch in rows:
        got += batch
    return got


async def test_history_is_read_in_pages_of_about_the_byte_bound(
    redis: Redis, prefix: str, small_hub: EventHub
) -> None:
    keys = Keys(prefix)
    for _ in range(60):
        await add(redis, keys.events("j"), text="d" * 4000)
    await add(redis, keys.events("j"), "done")
    feed = JobFeed(small_hub, keys, "j", ended=True)
    pages = [rows async for rows in feed.batches()]
    assert sum(len(rows) for rows in pages) == 61
    assert rows_size(pages[0]) < 3 * 16_384  # the first page: sized from a guess
    assert all(rows_size(rows) <= 16_384 for rows in pages[1:])  # then from what it saw
    assert len(pages) > 10


async def eventually_async(check: Any, timeout: float = 5) -> None:
    async def checked() -> bool:
        return bool(check())

    await eventually(checked, timeout)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "drop"]), st.sampled_from("abcdé"), st.integers(0, 9)),
        max_size=30,
    )
)
def test_the_hand_packed_xread_is_what_redis_py_would_send(ops: list[Any]) -> None:
    from redis.asyncio.connection import Connection

    command, model = ReadCommand(500, 2000), dict[str, str]()
    for op, key, seq in ops:
        if op == "set":
            command.set(f"p:job:{{{key}}}:events", f"17-{seq}")
            model[f"p:job:{{{key}}}:events"] = f"17-{seq}"
        elif f"p:job:{{{key}}}:events" in model:
            command.drop(f"p:job:{{{key}}}:events")
            del model[f"p:job:{{{key}}}:events"]
    args: list[str | int] = [
        "XREAD",
        "COUNT",
        500,
        "BLOCK",
        2000,
        "STREAMS",
        *model,
        *model.values(),
    ]
    assert command.packed() == b"".join(Connection().pack_command(*args))
