"""Accumulator vectors (data strings -> final message + published deltas) and properties."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.chunks import ChatCompletionChunk
from worker.accumulator import Accumulator, Delta, FinalMessage, merge_all
from worker.errors import MidStreamError, ProtocolError, TruncatedStreamError

USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> str:
    body: dict[str, Any] = {
        "id": "gen-1",
        "object": "chat.completion.chunk",
        "created": 1751299200,
        "model": "z-ai/glm-5.2",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }
    body.update(top)
    return json.dumps(body)


def bare(**top: Any) -> str:
    """A chunk with empty choices (the usage chunk) plus the given top-level fields."""
    return json.dumps({"id": "gen-1", "object": "chat.completion.chunk", "choices": [], **top})


def tc(
    index: int | None = None, id: str | None = None, name: str | None = None, args: Any = None
) -> dict[str, Any]:
    frag: dict[str, Any] = {}
    if index is not None:
        frag["index"] = index
    if id is not None:
        frag.update(id=id, type="function")
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    if fn:
        frag["function"] = fn
    return frag


def call(id: str, name: str, args: str) -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": args}}


def run(datas: list[str]) -> tuple[FinalMessage, list[dict[str, Any]]]:
    acc = Accumulator()
    deltas = [d.to_json() for d in map(acc.feed_data, datas) if d is not None]
    return acc.finish(), deltas


A = {"role": "assistant"}
STOP = chunk(finish="stop")
DONE = "[DONE]"

VECTORS: list[Any] = [
    pytest.param(
        [
            chunk({**A, "content": "A gateway"}),
            chunk({"content": " is a single entry point."}),
            STOP,
            DONE,
        ],
        {
            "role": "assistant",
            "content": "A gateway is a single entry point.",
            "finish_reason": "stop",
            "end": "done",
            "completion_id": "gen-1",
            "model": "z-ai/glm-5.2",
            "usage": None,
            "error": None,
        },
        [{"role": "assistant", "content": "A gateway"}, {"content": " is a single entry point."}],
        id="seed-text",
    ),
    pytest.param(
        [
            chunk(A),
            chunk({**A, "content": "a"}),
            chunk({"role": "assistant", "content": "b"}),
            STOP,
            DONE,
        ],
        {"role": "assistant", "content": "ab"},
        [{"role": "assistant"}, {"content": "a"}, {"content": "b"}],
        id="role-once",
    ),
    pytest.param(
        [
            chunk({"content": "a"}),
            chunk({"content": None}),
            chunk({"role": None, "content": "b"}),
            chunk({}),
            chunk({"content": ""}),
            STOP,
        ],
        {"role": "assistant", "content": "ab", "end": "complete"},
        [{"content": "a"}, {"content": "b"}],
        id="null-never-erases",
    ),
    pytest.param(
        [
            chunk({**A, "content": "the text [DONE] and\n\ndata: [DONE]\n\n"}),
            chunk({"content": "[DONE]"}),
            STOP,
            DONE,
        ],
        {"content": "the text [DONE] and\n\ndata: [DONE]\n\n[DONE]", "end": "done"},
        [
            {"role": "assistant", "content": "the text [DONE] and\n\ndata: [DONE]\n\n"},
            {"content": "[DONE]"},
        ],
        id="done-inside-content",
    ),
    pytest.param(
        [
            chunk({**A, "tool_calls": [tc(0, "call_1", "get_weather", "")]}),
            chunk({"tool_calls": [tc(0, args='{"city":')]}),
            chunk({"tool_calls": [tc(0, args='"Paris"}')]}),
            chunk(finish="tool_calls"),
            DONE,
        ],
        {
            "tool_calls": [call("call_1", "get_weather", '{"city":"Paris"}')],
            "finish_reason": "tool_calls",
            "content": "",
        },
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather"},
                    }
                ],
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
        ],
        id="tool-call-fragments",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [tc(0, "c0", "f", "[0"), tc(1, "c1", "g", "[1")]}),
            chunk({"tool_calls": [tc(1, args="1]")]}),
            chunk({"tool_calls": [tc(0, args="0]")]}),
        ],
        {"tool_calls": [call("c0", "f", "[00]"), call("c1", "g", "[11]")], "end": "truncated"},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "[0"},
                    },
                    {
                        "index": 1,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "g", "arguments": "[1"},
                    },
                ]
            },
            {"tool_calls": [{"index": 1, "function": {"arguments": "1]"}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": "0]"}}]},
        ],
        id="parallel-calls",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [tc(1, "c1", "g", "{")]}),
            chunk({"tool_calls": [tc(0, "c0", "f", "{}")]}),
            chunk({"tool_calls": [tc(1, args="}")]}),
        ],
        {"tool_calls": [call("c0", "f", "{}"), call("c1", "g", "{}")]},
        [
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "g", "arguments": "{"},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ]
            },
            {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]},
        ],
        id="first-index-1-ordered-by-index",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [tc(0, "c0", "f", "a"), tc(1, "c1", "g", "b")]}),
            chunk({"tool_calls": [{"function": {"arguments": "B"}}]}),
            chunk({"tool_calls": [{"id": "c0", "function": {"arguments": "A"}}]}),
        ],
        {"tool_calls": [call("c0", "f", "aA"), call("c1", "g", "bB")]},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "a"},
                    },
                    {
                        "index": 1,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "g", "arguments": "b"},
                    },
                ]
            },
            {"tool_calls": [{"index": 1, "function": {"arguments": "B"}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": "A"}}]},
        ],
        id="no-index-joins-same-id-else-last",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}),
            chunk({"tool_calls": [{"function": {"arguments": "}"}}]}),
        ],
        {
            "tool_calls": [
                {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]
        },
        [
            {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        ],
        id="no-index-no-id-first-call",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [tc(None, "c0", "f", "{}")]}),
            chunk({"tool_calls": [tc(None, "c1", "g", "[]")]}),
        ],
        {"tool_calls": [call("c0", "f", "{}"), call("c1", "g", "[]")]},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "g", "arguments": "[]"},
                    }
                ]
            },
        ],
        id="no-index-new-id-new-call",
    ),
    pytest.param(
        [
            chunk({"tool_calls": [tc(0, "c0", "f", "{")]}),
            chunk({"tool_calls": [tc(0, "c0", "f", "}")]}),
            chunk({"tool_calls": [tc(0, "", "", "")]}),
            chunk({"tool_calls": [{"index": 0}]}),
        ],
        {"tool_calls": [call("c0", "f", "{}")]},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{"},
                    }
                ]
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        ],
        id="id-name-kept-not-concatenated",
    ),
    pytest.param(
        [chunk({"tool_calls": [tc(0, "c0", "f", {"city": "Zürich", "n": [1, 2]})]}), STOP, DONE],
        {"tool_calls": [call("c0", "f", '{"city":"Zürich","n":[1,2]}')]},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"city":"Zürich","n":[1,2]}'},
                    }
                ]
            }
        ],
        id="arguments-as-object",
    ),
    pytest.param(
        [chunk({"tool_calls": [tc(0, "c0", "f", "{"), tc(0, args='"a"'), tc(0, args="}")]})],
        {"tool_calls": [call("c0", "f", '{"a"}')]},
        [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c0",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a"}'},
                    }
                ]
            }
        ],
        id="same-index-twice-in-one-chunk",
    ),
    pytest.param(
        [
            chunk(
                {
                    **A,
                    "reasoning_details": [
                        {
                            "type": "reasoning.text",
                            "text": "Let",
                            "signature": None,
                            "format": "anthropic-claude-v1",
                        }
                    ],
                }
            ),
            chunk(
                {
                    "reasoning_details": [
                        {"type": "reasoning.text", "text": " me", "format": "other"}
                    ]
                }
            ),
            chunk(
                {"reasoning_details": [{"type": "reasoning.text", "text": "", "signature": "sig"}]}
            ),
            chunk({"content": "Hi"}),
            STOP,
            DONE,
        ],
        {
            "reasoning": [
                {
                    "type": "reasoning.text",
                    "text": "Let me",
                    "format": "anthropic-claude-v1",
                    "signature": "sig",
                }
            ],
            "content": "Hi",
        },
        [
            {
                "role": "assistant",
                "reasoning_details": [
                    {"type": "reasoning.text", "text": "Let", "format": "anthropic-claude-v1"}
                ],
            },
            {"reasoning_details": [{"type": "reasoning.text", "text": " me", "format": "other"}]},
            {"reasoning_details": [{"type": "reasoning.text", "text": "", "signature": "sig"}]},
            {"content": "Hi"},
        ],
        id="reasoning-text-merges",
    ),
    pytest.param(
        [
            chunk(
                {
                    "reasoning_details": [
                        {"type": "reasoning.summary", "summary": "S1"},
                        {"type": "reasoning.summary", "summary": "S2"},
                        {"type": "reasoning.encrypted", "data": "E1"},
                    ]
                }
            ),
            chunk(
                {
                    "reasoning_details": [
                        {"type": "reasoning.encrypted", "data": "E2"},
                        {"type": "reasoning.text", "text": "T"},
                    ]
                }
            ),
        ],
        {
            "reasoning": [
                {"type": "reasoning.summary", "summary": "S1S2"},
                {"type": "reasoning.encrypted", "data": "E1"},
                {"type": "reasoning.encrypted", "data": "E2"},
                {"type": "reasoning.text", "text": "T"},
            ]
        },
        [
            {
                "reasoning_details": [
                    {"type": "reasoning.summary", "summary": "S1S2"},
                    {"type": "reasoning.encrypted", "data": "E1"},
                ]
            },
            {
                "reasoning_details": [
                    {"type": "reasoning.encrypted", "data": "E2"},
                    {"type": "reasoning.text", "text": "T"},
                ]
            },
        ],
        id="reasoning-type-change-and-encrypted-whole",
    ),
    pytest.param(
        [
            chunk({"reasoning_details": [{"type": "reasoning.text", "text": "a", "index": 0}]}),
            chunk({"reasoning_details": [{"type": "reasoning.text", "text": "b"}]}),
            chunk({"reasoning_details": [{"type": "reasoning.text", "text": "c", "index": 1}]}),
        ],
        {
            "reasoning": [
                {"type": "reasoning.text", "text": "ab", "index": 0},
                {"type": "reasoning.text", "text": "c", "index": 1},
            ]
        },
        [
            {"reasoning_details": [{"type": "reasoning.text", "text": "a", "index": 0}]},
            {"reasoning_details": [{"type": "reasoning.text", "text": "b", "index": 0}]},
            {"reasoning_details": [{"type": "reasoning.text", "text": "c", "index": 1}]},
        ],
        id="reasoning-index-change-new-entry",
    ),
    pytest.param(
        [
            chunk({**A, "reasoning": "think"}),
            chunk({"reasoning_content": "ing"}),
            chunk(
                {"reasoning": "dup", "reasoning_details": [{"type": "reasoning.text", "text": "!"}]}
            ),
            chunk({"reasoning": None, "content": "x"}),
        ],
        {"reasoning": [{"type": "reasoning.text", "text": "thinking!"}], "content": "x"},
        [
            {
                "role": "assistant",
                "reasoning_details": [{"type": "reasoning.text", "text": "think"}],
            },
            {"reasoning_details": [{"type": "reasoning.text", "text": "ing"}]},
            {"reasoning_details": [{"type": "reasoning.text", "text": "!"}]},
            {"content": "x"},
        ],
        id="plain-reasoning-string",
    ),
    pytest.param(
        [
            chunk({**A, "content": "a"}, usage=None),
            chunk(finish="stop", usage={"total_tokens": 1}),
            bare(usage=USAGE),
            bare(usage=None),
            DONE,
        ],
        {"usage": USAGE, "end": "done", "finish_reason": "stop"},
        [{"role": "assistant", "content": "a"}],
        id="usage-last-non-null-never-summed",
    ),
    pytest.param(
        [
            chunk({"content": "a"}, web_search={"q": 1}, free_tier=None),
            chunk(finish="stop", free_tier={"eligible": True}, web_search=None),
            DONE,
        ],
        {"extras": {"web_search": {"q": 1}, "free_tier": {"eligible": True}}},
        [{"content": "a"}],
        id="extras",
    ),
    pytest.param(
        [
            chunk({**A, "content": "partial"}),
            chunk({"content": " out"}, "error", error={"code": 502, "message": "provider died"}),
            chunk({"content": "ignored"}),
            "not json, ignored",
            DONE,
        ],
        {
            "content": "partial out",
            "end": "error",
            "finish_reason": "error",
            "error": {"code": 502, "message": "provider died"},
        },
        [{"role": "assistant", "content": "partial"}, {"content": " out"}],
        id="mid-stream-error",
    ),
    pytest.param(
        [chunk({"content": "a"}, error=None), STOP, DONE],
        {"content": "a", "end": "done", "error": None},
        [{"content": "a"}],
        id="error-null-is-not-an-error",
    ),
    pytest.param(
        [
            chunk({"content": "a"}, error=False),
            bare(error=""),
            bare(error={}),
            chunk(finish="stop"),
            chunk(finish=""),
            DONE,
        ],
        {"content": "a", "end": "done", "error": None, "finish_reason": "stop"},
        [{"content": "a"}],
        id="empty-error-values-and-empty-finish-reason",
    ),
    pytest.param(
        [chunk({"content": "a"}), bare(error="overloaded")],
        {"end": "error", "error": {"message": "overloaded"}, "content": "a"},
        [{"content": "a"}],
        id="error-string",
    ),
    pytest.param(
        [chunk({"content": "a"}), chunk(finish="error")],
        {"end": "error", "finish_reason": "error", "content": "a"},
        [{"content": "a"}],
        id="finish-reason-error-without-object",
    ),
    pytest.param(
        [chunk({"content": "a"}), STOP, DONE, chunk({"content": "late"}), "{bad", DONE],
        {"content": "a", "end": "done"},
        [{"content": "a"}],
        id="after-done-ignored",
    ),
    pytest.param(
        [chunk({"content": "a"}), chunk(finish="length")],
        {"end": "complete", "finish_reason": "length"},
        [{"content": "a"}],
        id="complete-without-done",
    ),
    pytest.param(
        [chunk({"content": "a"})],
        {"end": "truncated", "finish_reason": None},
        [{"content": "a"}],
        id="truncated",
    ),
    pytest.param(
        [],
        {"end": "truncated", "role": "assistant", "content": "", "tool_calls": [], "reasoning": []},
        [],
        id="empty",
    ),
    pytest.param(
        [
            json.dumps(
                {
                    "choices": [
                        {"index": 1, "delta": {"content": "other"}},
                        {"index": 0, "delta": {"content": "zero"}},
                    ]
                }
            ),
            json.dumps(
                {"choices": [{"index": 1, "delta": {"content": "x"}, "finish_reason": "stop"}]}
            ),
        ],
        {"content": "zero", "finish_reason": None},
        [{"content": "zero"}],
        id="only-choice-0",
    ),
    pytest.param(
        [
            json.dumps({"choices": [{"delta": {"content": "a"}}]}),
            json.dumps({"id": "", "model": None, "choices": [{"delta": {"content": "b"}}]}),
            json.dumps({"id": "first", "model": "m1", "choices": [{"delta": None}]}),
            json.dumps({"id": "second", "model": "m2", "choices": [{"finish_reason": "stop"}]}),
        ],
        {"completion_id": "first", "model": "m1", "content": "ab", "end": "complete"},
        [{"content": "a"}, {"content": "b"}],
        id="ids-from-first-chunk-that-has-them",
    ),
    pytest.param(
        ["", chunk({"content": "a"})],
        {"content": "a"},
        [{"content": "a"}],
        id="empty-data-ignored",
    ),
]


@pytest.mark.parametrize(("datas", "final", "deltas"), VECTORS)
def test_vectors(datas: list[str], final: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
    message, published = run(datas)
    assert {key: getattr(message, key) for key in final} == final
    assert published == deltas
    # merging all published deltas gives the final message
    merged = Delta()
    for delta in published:
        merged.merge(Delta.from_json(delta))
    assert merged.content == message.content
    assert merged.reasoning_details == message.reasoning
    assert final_calls(merged) == message.tool_calls


@given(data=st.data())
@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
@pytest.mark.parametrize(("datas", "final", "deltas"), VECTORS)
def test_fold_and_take_at_any_points_equals_feed_data(
    datas: list[str],
    final: dict[str, Any],
    deltas: list[dict[str, Any]],
    as_bytes: bool,
    data: st.DataObject,
) -> None:
    """fold()/take_delta() (one delta per network read) give the same final message as
    feed_data(), and the taken deltas merge to it, wherever the takes fall; also for raw
    bytes, where chunk templates apply."""
    acc, merged = Accumulator(), Delta()
    for item in datas:
        acc.fold(item.encode() if as_bytes else item)
        if data.draw(st.booleans()):
            taken = acc.take_delta()
            if taken is not None:
                merged.merge(Delta.from_json(taken.to_json()))
    last = acc.take_delta()
    if last is not None:
        merged.merge(last)
    assert acc.take_delta() is None
    message = acc.finish()
    assert {key: getattr(message, key) for key in final} == final
    assert merged.content == message.content
    assert merged.reasoning_details == message.reasoning
    assert final_calls(merged) == message.tool_calls
    assert merged.role == (message.role if any("role" in d for d in deltas) else None)


def test_what_was_folded_before_an_invalid_chunk_can_still_be_taken() -> None:
    acc = Accumulator()
    acc.fold(chunk({"role": "assistant", "content": "a"}))
    acc.fold(chunk({"content": "b"}))
    with pytest.raises(ProtocolError):
        acc.fold("{broken")
    taken = acc.take_delta()
    assert taken is not None and taken.to_json() == {"role": "assistant", "content": "ab"}
    assert acc.finish().content == "ab"


def test_state_properties_and_exception() -> None:
    acc = Accumulator()
    assert not (acc.done or acc.finished or acc.errored)
    assert isinstance(acc.finish().exception(), TruncatedStreamError)
    acc.feed_data(chunk({"content": "a"}, "stop"))
    assert acc.finish_reason == "stop"
    assert acc.finish().exception() is None
    acc.feed_data(DONE)
    assert acc.done and acc.finished and not acc.errored
    assert acc.finish().exception() is None

    acc = Accumulator()
    acc.feed_data(chunk({}, "error", error={"code": 429, "message": "rate limited"}))
    assert acc.errored and acc.finished and not acc.done
    exc = acc.finish().exception()
    assert isinstance(exc, MidStreamError)
    assert (exc.message, exc.status, exc.detail) == (
        "rate limited",
        429,
        {"code": 429, "message": "rate limited"},
    )
    assert acc.feed_data(DONE) is None and not acc.done


def test_delta_api() -> None:
    delta = Delta()
    assert delta.is_empty() and delta.to_json() == {}
    delta.merge(
        Delta("assistant", "a", [], [{"index": 0, "id": "c", "function": {"arguments": "x"}}])
    )
    other = Delta(
        "user", "b", [], [{"index": 0, "id": "d", "function": {"name": "n", "arguments": "y"}}]
    )
    delta.merge(other)
    assert delta.to_json() == {
        "role": "assistant",
        "content": "ab",
        "tool_calls": [{"index": 0, "id": "c", "function": {"arguments": "xy", "name": "n"}}],
    }
    assert other.tool_calls == [
        {"index": 0, "id": "d", "function": {"name": "n", "arguments": "y"}}
    ]
    assert Delta.from_json(delta.to_json()) == delta
    assert not delta.is_empty()
    bad_values: list[Any] = [
        [],
        {"content": 1},
        {"tool_calls": [{"id": "x"}]},
        {"reasoning_details": "x"},
    ]
    for bad in bad_values:
        with pytest.raises(ProtocolError):
            Delta.from_json(bad)


def test_finish_is_repeatable_and_does_not_alias_state() -> None:
    acc = Accumulator()
    acc.feed_data(chunk({"reasoning_details": [{"type": "reasoning.text", "text": "a"}]}))
    first = acc.finish()
    first.reasoning[0]["text"] = "changed"
    acc.feed_data(chunk({"reasoning_details": [{"type": "reasoning.text", "text": "b"}]}))
    assert acc.finish().reasoning == [{"type": "reasoning.text", "text": "ab"}]


def test_chunks_validate_against_schema() -> None:
    for data in (
        chunk({**A, "content": "x", "tool_calls": [tc(0, "c", "f", "{}")]}),
        bare(usage=USAGE),
        chunk({}, "error", error={"code": 502, "message": "m"}, unknown_field=1),
    ):
        parsed = ChatCompletionChunk.model_validate_json(data)
        assert parsed.model_dump(exclude_unset=True) == json.loads(data)


# --- protocol errors ----------------------------------------------------------------------


def test_invalid_json_names_the_bytes() -> None:
    with pytest.raises(ProtocolError, match=r"invalid JSON.*'\{\"choices\": \[oops"):
        Accumulator().feed_data('{"choices": [oops')
    long = "{" + "x" * 5000
    with pytest.raises(ProtocolError) as info:
        Accumulator().feed_data(long)
    assert "xxxx" in info.value.message and "…" in info.value.message
    assert len(info.value.message) < 300
    with pytest.raises(ProtocolError):
        Accumulator().feed_data("[DONE] ")  # [DONE] counts only as the whole data field


def test_a_lone_surrogate_or_invalid_utf8_is_handled_like_any_bad_text() -> None:
    """A str the JSON parser cannot encode is invalid JSON; invalid UTF-8 in raw bytes
    becomes U+FFFD, as the SSE decoder's events have it."""
    with pytest.raises(ProtocolError, match="invalid JSON"):
        Accumulator().feed_data('{"choices": [{"delta": {"content": "a\ud800"}}]}')
    acc = Accumulator()
    acc.fold_all([chunk({"content": "ab"}).encode().replace(b"ab", b"a\xffb")])
    assert acc.finish().content == "a\ufffdb"


def c0(delta: Any = None, **choice: Any) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta, **choice}]})


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("[1, 2]", "chunk must be a JSON object"),
        ("null", "chunk must be a JSON object"),
        (json.dumps({"choices": {"0": {}}}), "choices must be a list"),
        (json.dumps({"choices": ["x"]}), "choice must be an object"),
        (c0("hi"), "delta must be an object"),
        (c0({"content": 5}), "content must be a string"),
        (c0({"content": ["a"]}), "content must be a string"),
        (c0({"role": 1}), "role must be a string"),
        (c0({"tool_calls": {"index": 0}}), "tool_calls must be a list"),
        (c0({"tool_calls": [None]}), "tool_calls entry must be an object"),
        (c0({"tool_calls": [{"index": -1, "id": "x"}]}), "non-negative integer"),
        (c0({"tool_calls": [{"index": "0", "id": "x"}]}), "non-negative integer"),
        (c0({"tool_calls": [{"index": True, "id": "x"}]}), "non-negative integer"),
        (c0({"tool_calls": [{"index": 0.0, "id": "x"}]}), "non-negative integer"),
        (c0({"tool_calls": [{"index": 0, "function": "f"}]}), "function must be an object"),
        (c0({"tool_calls": [{"index": 0, "function": {"arguments": 3}}]}), "arguments must be"),
        (c0({"tool_calls": [{"index": 0, "id": 7}]}), "id must be a string"),
        (c0({"tool_calls": [{"index": 0, "function": {"name": ["f"]}}]}), "name must be a string"),
        (c0({"reasoning_details": {"type": "x"}}), "reasoning_details must be a list"),
        (c0({"reasoning_details": ["x"]}), "reasoning_details entry must be an object"),
        (
            c0({"reasoning_details": [{"type": "reasoning.text", "text": 1}]}),
            "text must be a string",
        ),
        (c0({"reasoning_details": [{"type": 1}]}), "type must be a string"),
        (c0({"reasoning": {"text": "x"}}), "reasoning must be a string"),
        (c0({}, finish_reason=1), "finish_reason must be a string"),
        (json.dumps({"usage": [1]}), "usage must be an object"),
    ],
)
def test_protocol_errors(data: str, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        Accumulator().feed_data(data)


# --- properties ---------------------------------------------------------------------------

TEXT = st.text(alphabet='ab{}"é😀\n', max_size=4)
# mostly reasoning.text, so that runs of joinable fragments (and index changes) are common
REASONING_TYPES = ("reasoning.text",) * 4 + ("reasoning.summary", "reasoning.encrypted")


@st.composite
def reasoning_fragment(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(REASONING_TYPES))
    body_key = {"reasoning.text": "text", "reasoning.summary": "summary"}.get(kind, "data")
    frag: dict[str, Any] = {"type": kind, body_key: draw(TEXT)}
    for key, values in (("index", st.sampled_from([0, 1])), ("signature", TEXT), ("format", TEXT)):
        if draw(st.booleans()):
            frag[key] = draw(st.none() | values)
    return frag


TOOL_FRAGMENT = st.fixed_dictionaries(
    {},
    optional={
        "index": st.integers(0, 2),
        "id": st.sampled_from(["", "c0", "c1", "c2"]),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {}, optional={"name": st.sampled_from(["", "f", "g"]), "arguments": TEXT | st.none()}
        ),
    },
)

DELTA = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["assistant", "user", None]),
        "content": TEXT | st.none(),
        "reasoning_details": st.lists(reasoning_fragment(), max_size=3),
        "reasoning": TEXT | st.none(),
        "tool_calls": st.lists(TOOL_FRAGMENT, max_size=3),
    },
)


def final_calls(delta: Delta) -> list[dict[str, Any]]:
    """Merged published tool-call fragments in the final message's shape."""
    out = []
    for frag in sorted(delta.tool_calls, key=lambda c: int(c["index"])):
        fn = frag.get("function", {})
        out.append(
            {
                "id": frag.get("id", ""),
                "type": frag.get("type") or "function",
                "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")},
            }
        )
    return out


@settings(max_examples=1000, deadline=None)
@given(deltas=st.lists(DELTA, max_size=12), data=st.data())
def test_coalesced_deltas_merge_to_the_final_message(
    deltas: list[dict[str, Any]], data: st.DataObject
) -> None:
    acc = Accumulator()
    published = [acc.add_chunk({"choices": [{"index": 0, "delta": d}]}) for d in deltas]
    events = [d for d in published if d is not None]
    assert all(not d.is_empty() for d in events)
    final = acc.finish()
    # coalesce in arbitrary consecutive groups (through JSON, like the publisher), then merge
    merged = Delta()
    i = 0
    while i < len(events):
        size = data.draw(st.integers(1, 4))
        group = Delta.from_json(json.loads(json.dumps(events[i].to_json())))
        for later in events[i + 1 : i + size]:
            group.merge(later)
        merged.merge(group)
        i += size
    assert merged.content == final.content
    assert (merged.role or "assistant") == final.role
    assert merged.reasoning_details == final.reasoning
    assert final_calls(merged) == final.tool_calls


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "delta",
                    "index",
                    "content",
                    "role",
                    "tool_calls",
                    "function",
                    "id",
                    "arguments",
                    "name",
                    "type",
                    "reasoning_details",
                    "reasoning",
                    "text",
                    "usage",
                    "error",
                    "finish_reason",
                    "model",
                    "web_search",
                ]
            )
            | st.text(max_size=3),
            inner,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(values=st.lists(JSON, max_size=5))
def test_arbitrary_json_raises_only_protocol_error(values: list[Any]) -> None:
    acc = Accumulator()
    for value in values:
        with contextlib.suppress(ProtocolError):
            acc.feed_data(json.dumps(value))
    acc.finish()


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(max_size=20), max_size=5))
def test_arbitrary_text_raises_only_protocol_error(texts: list[str]) -> None:
    acc = Accumulator()
    for text in texts:
        with contextlib.suppress(ProtocolError):
            acc.feed_data(text)
    acc.finish()


def test_deep_nesting_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        Accumulator().feed_data("[" * 100_000)


@settings(max_examples=500, deadline=None)
@given(deltas=st.lists(DELTA, max_size=12))
def test_merge_all_equals_merging_one_by_one(deltas: list[dict[str, Any]]) -> None:
    acc = Accumulator()
    published = [acc.add_chunk({"choices": [{"index": 0, "delta": d}]}) for d in deltas]
    events = [d for d in published if d is not None]
    one_by_one = Delta()
    for event in events:
        one_by_one.merge(Delta.from_json(event.to_json()))
    assert merge_all([Delta.from_json(e.to_json()) for e in events]) == one_by_one
