"""The upstream protocol's less common fields, end to end: a real worker, redis-server and
the mock upstream replaying provider-shaped chunks (``mock.script``).

Each test checks the record, the events stream as stored (its deltas merged by
``Delta.merge`` equal the record: :func:`check_stream`) and the terminal entry.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.events import EventType
from schemas.jobs import JobRecord
from tests.helpers.checks import check_stream, merge_deltas, output_of, stream_entries
from tests.helpers.harness import Harness, chat

USAGE = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0, **top: Any) -> str:
    """An OpenAI-shaped chunk (``usage: null`` and ``obfuscation`` on every chunk), as JSON
    text whose lone surrogates are escapes, as an upstream must send them."""
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    body = {"id": "chatcmpl-p", "object": "chat.completion.chunk", "created": 1751299200,
            "model": "gpt-test", "choices": [choice], "usage": None, "obfuscation": "x1Yz",
            **top}  # fmt: skip
    return json.dumps(body)


def usage_chunk(**top: Any) -> str:
    return json.dumps({"id": "chatcmpl-p", "choices": [], "usage": USAGE, **top})


async def run(harness: Harness, script: list[str]) -> tuple[JobRecord, list[Any]]:
    record = await harness.run(chat("protocol", script=script))
    events = await stream_entries(harness.redis, harness.worker.keys, record.id)
    check_stream(events, record)
    return record, events


A = {"role": "assistant"}
R = "reasoning.text"
F = "anthropic-claude-v1"


async def test_n_choices_each_accumulate_and_choice_0_keeps_its_shape(harness: Harness) -> None:
    record, events = await run(
        harness,
        [
            chunk({**A, "content": "", "refusal": None}),
            chunk({**A, "content": ""}, index=1),
            chunk({"content": "Hello"}),
            chunk({"refusal": "I can't"}, index=1),
            chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": '{"a":'}}]}, index=2),
            chunk({"content": " there"}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, index=2),
            chunk({}, "stop"),
            chunk({}, "stop", index=1),
            chunk({}, "tool_calls", index=2),
            usage_chunk(),
            "[DONE]",
        ],
    )  # fmt: skip
    assert record.status == "succeeded"
    assert (record.content, record.finish_reason, record.refusal) == ("Hello there", "stop", "")
    assert record.choices == [
        {"index": 1, "role": "assistant", "content": "", "refusal": "I can't", "reasoning": [],
         "tool_calls": [], "finish_reason": "stop"},
        {"index": 2, "role": "assistant", "content": "", "refusal": "", "reasoning": [],
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a":1}'}}],
         "finish_reason": "tool_calls"},
    ]  # fmt: skip
    assert events[-1].type is EventType.DONE
    assert events[-1].data == {
        "finish_reason": "stop",
        "usage": USAGE,
        "served": {"upstream": "default", "model": "mock-model"},
        "choices": [
            {"index": 1, "finish_reason": "stop"},
            {"index": 2, "finish_reason": "tool_calls"},
        ],
    }
    deltas = [e.data for e in events if e.type is EventType.DELTA]
    assert all("index" not in d for d in deltas)  # choice 0: the top level, as with n = 1
    assert {c["index"] for d in deltas for c in d.get("choices", [])} == {1, 2}


async def test_refusal_is_recorded_and_published(harness: Harness) -> None:
    record, events = await run(
        harness,
        [
            chunk({**A, "content": "", "refusal": None}),
            chunk({"refusal": "I'm sorry, "}),
            chunk({"refusal": "I can't help with that."}),
            chunk({}, "stop"),
            "[DONE]",
        ],
    )
    assert (record.status, record.content) == ("succeeded", "")
    assert record.refusal == merge_deltas(events).refusal == "I'm sorry, I can't help with that."


async def test_surrogate_pairs_split_across_chunks_join_everywhere(harness: Harness) -> None:
    """A gateway that splits text by UTF-16 code units sends each half of an emoji as an
    escape in its own chunk: the job succeeds, the record and the merged deltas hold the
    character, and a surrogate that never finds its other half is U+FFFD."""
    record, events = await run(
        harness,
        [
            chunk({**A, "content": "hi \ud83d"}),
            chunk({"content": "\ude00 and \udfff!"}),
            chunk({"reasoning_details": [{"type": R, "text": "think \ud83e"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "\udd14"}]}),
            chunk({"refusal": "\ud83d"}),
            chunk({"refusal": "\udeab"}),
            chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                   "function": {"name": "f", "arguments": '{"q":"\ud83d'}}]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": '\ude80"}'}}]}),
            chunk({"content": " bye \ud83d"}, "stop"),
            "[DONE]",
        ],
    )  # fmt: skip
    assert record.status == "succeeded", record.error
    assert record.content == "hi 😀 and \ufffd! bye \ufffd"
    assert record.reasoning == [{"type": R, "text": "think 🤔"}]
    assert record.refusal == "🚫"
    assert record.tool_calls[0]["function"]["arguments"] == '{"q":"🚀"}'
    assert output_of(merge_deltas(events)) == output_of(record)


async def test_every_reasoning_signature_is_kept(harness: Harness) -> None:
    """Anthropic-style thinking blocks without an index: each ends with its signature and
    must be passed back verbatim, so the two never merge."""
    record, _ = await run(
        harness,
        [
            chunk({**A, "reasoning_details": [{"type": R, "text": "First ", "format": F}]}),
            chunk({"reasoning_details": [{"type": R, "text": "block.", "signature": None}]}),
            chunk({"reasoning_details": [{"type": R, "text": "", "signature": "sig-1"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "Second block.", "format": F}]}),
            chunk({"reasoning_details": [{"type": R, "text": "", "signature": "sig-2"}]}),
            chunk({"content": "Answer"}, "stop"),
            "[DONE]",
        ],
    )  # fmt: skip
    assert record.reasoning == [
        {"type": R, "text": "First block.", "format": F, "signature": "sig-1"},
        {"type": R, "text": "Second block.", "format": F, "signature": "sig-2"},
    ]


async def test_provider_extras_reach_the_terminal_entry(harness: Harness) -> None:
    search = {"results": [{"url": "https://example.org", "title": "É"}]}
    record, events = await run(
        harness,
        [
            chunk({**A, "content": "a"}, web_search=search),
            chunk({}, "stop", web_search=None),
            usage_chunk(free_tier={"eligible": True}),
            "[DONE]",
        ],
    )
    assert (record.web_search, record.free_tier) == (search, {"eligible": True})
    assert events[-1].data == {
        "finish_reason": "stop",
        "usage": USAGE,
        "served": {"upstream": "default", "model": "mock-model"},
        "web_search": search,
        "free_tier": {"eligible": True},
    }
    _, failed = await run(
        harness,
        [chunk({"content": "a"}, free_tier={"eligible": False}),
         json.dumps({"choices": [], "error": {"code": 502, "message": "boom"}})],
    )  # fmt: skip
    assert failed[-1].type is EventType.ERROR
    assert failed[-1].data["free_tier"] == {"eligible": False}
