"""Accumulator vectors (data fields -> final message + published deltas) and properties.

Everything goes through what the pipeline runs: ``fold_all`` on raw data fields,
``take_delta`` for the delta to publish, ``Delta.merge`` for merging published deltas
(the publisher's coalescing; a consumer rebuilding the reply), ``finish``.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.chunks import ChatCompletionChunk
from tests.helpers.checks import merged, output_of
from worker.errors import MidStreamError, ProtocolError, TruncatedStreamError
from worker.protocol.accumulator import Accumulator, Delta, FinalMessage

USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0, **top: Any
) -> str:
    """A chunk as JSON text (``json.dumps``: lone surrogates become ``\\u`` escapes)."""
    body: dict[str, Any] = {
        "id": "gen-1",
        "object": "chat.completion.chunk",
        "created": 1751299200,
        "model": "z-ai/glm-5.2",
        "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}],
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


def fold(acc: Accumulator, *datas: str) -> int:
    """Fold data fields given as text, as one read."""
    return acc.fold_all([data.encode() for data in datas])


def run(datas: list[str]) -> tuple[FinalMessage, list[dict[str, Any]]]:
    """One read per data field, a delta taken after each (one event per read)."""
    acc = Accumulator()
    deltas = []
    for data in datas:
        fold(acc, data)
        delta = acc.take_delta()
        if delta is not None:
            deltas.append(dict(delta))
    return acc.finish(), deltas


A = {"role": "assistant"}
STOP = chunk(finish="stop")
DONE = "[DONE]"
R = "reasoning.text"

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
            {
                "reasoning_details": [
                    {"type": "reasoning.text", "text": " me", "format": "anthropic-claude-v1"}
                ]
            },
            {
                "reasoning_details": [
                    {
                        "type": "reasoning.text",
                        "text": "",
                        "format": "anthropic-claude-v1",
                        "signature": "sig",
                    }
                ]
            },
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
        [chunk({**A, "content": "a"}), chunk({"content": "b"}, error={"message": "cut"}), DONE],
        {"content": "ab", "end": "error", "error": {"message": "cut"}, "finish_reason": None},
        [{"role": "assistant", "content": "a"}, {"content": "b"}],
        id="error-beside-a-plain-delta",
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
        {
            "content": "zero",
            "finish_reason": None,
            "end": "truncated",
            "choices": [
                {
                    "index": 1,
                    "role": "assistant",
                    "content": "otherx",
                    "refusal": "",
                    "reasoning": [],
                    "tool_calls": [],
                    "finish_reason": "stop",
                }
            ],
        },
        [
            {"content": "zero", "choices": [{"index": 1, "content": "other"}]},
            {"choices": [{"index": 1, "content": "x"}]},
        ],
        id="n-choices-each-accumulates",
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


# the protocol gaps of issue 10: refusal, signatures, split surrogates, null trailers, n > 1
VECTORS += [
    pytest.param(
        [
            chunk({**A, "content": "", "refusal": None}),
            chunk({"refusal": "I can't "}),
            chunk({"refusal": "help with that."}),
            chunk({"refusal": None, "content": None}),
            chunk(finish="stop"),
            DONE,
        ],
        {"refusal": "I can't help with that.", "content": "", "end": "done"},
        [{"role": "assistant"}, {"refusal": "I can't "}, {"refusal": "help with that."}],
        id="refusal-accumulates",
    ),
    pytest.param(
        [
            chunk({"reasoning_details": [{"type": R, "text": "first", "signature": None}]}),
            chunk({"reasoning_details": [{"type": R, "text": "", "signature": "s1"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "second"}]}),
            chunk({"reasoning_details": [{"type": R, "text": " block", "signature": "s2"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "", "signature": "s2"}]}),
        ],
        {
            "reasoning": [
                {"type": R, "text": "first", "signature": "s1"},
                {"type": R, "text": "second block", "signature": "s2"},
                {"type": R, "text": "", "signature": "s2"},
            ]
        },
        [
            {"reasoning_details": [{"type": R, "text": "first"}]},
            {"reasoning_details": [{"type": R, "text": "", "signature": "s1"}]},
            {"reasoning_details": [{"type": R, "text": "second"}]},
            {"reasoning_details": [{"type": R, "text": " block", "signature": "s2"}]},
            {"reasoning_details": [{"type": R, "text": "", "signature": "s2"}]},
        ],
        id="a-signature-ends-its-block-and-is-never-dropped",
    ),
    pytest.param(
        [
            chunk({**A, "content": "a\ud83d"}),
            chunk({"content": "\ude00b"}),
            chunk({"reasoning_details": [{"type": R, "text": "\ud83e"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "\udd14!"}]}),
            chunk({"tool_calls": [tc(0, "c", "f", '{"q":"\ud83d')]}),
            chunk({"tool_calls": [tc(0, args='\ude80"}')]}),
            chunk({"refusal": "x\ud83d"}),
            chunk({"refusal": "\ude00"}),
            chunk(finish="stop"),
            DONE,
        ],
        {
            "content": "a😀b",
            "reasoning": [{"type": R, "text": "🤔!"}],
            "tool_calls": [call("c", "f", '{"q":"🚀"}')],
            "refusal": "x😀",
            "end": "done",
        },
        [
            {"role": "assistant", "content": "a"},
            {"content": "😀b"},
            {"reasoning_details": [{"type": R, "text": ""}]},  # the entry, its text waiting
            {"reasoning_details": [{"type": R, "text": "🤔!"}]},
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"q":"'},
                    }
                ]
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": '🚀"}'}}]},
            {"refusal": "x"},
            {"refusal": "😀"},
        ],
        id="surrogate-pairs-split-across-chunks-join",
    ),
    pytest.param(
        [
            chunk({"content": "a\ud83d"}),
            chunk({"content": "b\ude00c\udc00"}),
            chunk({"content": "\ud83d"}, "stop"),
        ],
        {"content": "a\ufffdb\ufffdc\ufffd\ufffd", "end": "complete"},
        [{"content": "a"}, {"content": "\ufffdb\ufffdc\ufffd"}, {"content": "\ufffd"}],
        id="lone-surrogates-become-replacement-characters",
    ),
    pytest.param(
        [
            chunk({"reasoning_details": [{"type": R, "text": "x\ud83d"}]}),
            chunk({"reasoning_details": [{"type": R, "text": "", "signature": "s"}]}),
        ],
        {"reasoning": [{"type": R, "text": "x\ufffd", "signature": "s"}], "end": "truncated"},
        [
            {"reasoning_details": [{"type": R, "text": "x"}]},
            {"reasoning_details": [{"type": R, "text": "\ufffd", "signature": "s"}]},
        ],
        id="a-signed-entry-waits-for-no-other-half",
    ),
    pytest.param(
        [chunk({"content": "a"}), chunk({"content": "\ud83d"})],
        {"content": "a", "end": "truncated"},
        [{"content": "a"}],
        id="a-first-half-still-waiting-is-not-output",
    ),
    pytest.param(
        [
            chunk({**A, "content": ""}, usage=None, obfuscation="x1"),
            chunk({"content": "a"}, usage=None, error=None, web_search=None, free_tier=None),
            chunk({"content": "b"}, usage=None, obfuscation="y22"),
            chunk({}, "stop", usage=None),
            bare(usage=USAGE, obfuscation="z"),
            DONE,
        ],
        {"content": "ab", "usage": USAGE, "extras": {}, "end": "done"},
        [{"role": "assistant"}, {"content": "a"}, {"content": "b"}],
        id="null-trailers-on-every-chunk",
    ),
    pytest.param(
        [
            chunk({**A, "content": "a"}),
            chunk({**A, "content": "b"}, index=1),
            chunk({"tool_calls": [tc(0, "c1", "g", "{}")]}, index=1),
            chunk({"reasoning_details": [{"type": R, "text": "t"}]}, index=2),
            chunk({"refusal": "no"}, index=2),
            chunk({"content": "c"}),
            json.dumps(
                {
                    "choices": [
                        {"index": 0, "delta": {}, "finish_reason": "stop"},
                        {"index": 1, "delta": {}, "finish_reason": "tool_calls"},
                        {"index": 2, "delta": {}, "finish_reason": "stop"},
                    ]
                }
            ),
        ],
        {
            "content": "ac",
            "finish_reason": "stop",
            "end": "complete",
            "choices": [
                {
                    "index": 1,
                    "role": "assistant",
                    "content": "b",
                    "refusal": "",
                    "reasoning": [],
                    "tool_calls": [call("c1", "g", "{}")],
                    "finish_reason": "tool_calls",
                },
                {
                    "index": 2,
                    "role": "assistant",
                    "content": "",
                    "refusal": "no",
                    "reasoning": [{"type": R, "text": "t"}],
                    "tool_calls": [],
                    "finish_reason": "stop",
                },
            ],
        },
        [
            {"role": "assistant", "content": "a"},
            {"choices": [{"index": 1, "role": "assistant", "content": "b"}]},
            {
                "choices": [
                    {
                        "index": 1,
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "g", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            {"choices": [{"index": 2, "reasoning_details": [{"type": R, "text": "t"}]}]},
            {"choices": [{"index": 2, "refusal": "no"}]},
            {"content": "c"},
        ],
        id="n-choices-with-tools-reasoning-refusal",
    ),
]


@pytest.mark.parametrize(("datas", "final", "deltas"), VECTORS)
def test_vectors(datas: list[str], final: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
    message, published = run(datas)
    assert {key: getattr(message, key) for key in final} == final
    assert published == deltas
    assert output_of(merged(published)) == output_of(message)


@given(data=st.data())
@pytest.mark.parametrize(("datas", "final", "deltas"), VECTORS)
def test_any_reads_and_takes_give_the_same(
    datas: list[str], final: dict[str, Any], deltas: list[dict[str, Any]], data: st.DataObject
) -> None:
    """However the fields fall into reads and wherever the takes fall, the final message
    is the same and the taken deltas (through JSON, as published) merge to it."""
    acc, taken = Accumulator(), []
    i = 0
    while i < len(datas):
        size = data.draw(st.integers(1, 3))
        fold(acc, *datas[i : i + size])
        i += size
        if data.draw(st.booleans()) and (delta := acc.take_delta()) is not None:
            taken.append(json.loads(json.dumps(delta)))
    last = acc.take_delta()
    if last is not None:
        taken.append(last)
    assert acc.take_delta() is None
    message = acc.finish()
    assert {key: getattr(message, key) for key in final} == final
    reply = merged(taken)
    assert output_of(reply) == output_of(message)
    assert reply.role == (message.role if any("role" in d for d in deltas) else None)


def test_what_was_folded_before_an_invalid_chunk_can_still_be_taken() -> None:
    acc = Accumulator()
    with pytest.raises(ProtocolError):
        fold(acc, chunk({"role": "assistant", "content": "a"}), chunk({"content": "b"}), "{broken")
    assert acc.take_delta() == {"role": "assistant", "content": "ab"}
    assert acc.finish().content == "ab"


def test_closed_truncated_and_exception() -> None:
    acc = Accumulator()
    assert acc.truncated and not acc.closed
    assert isinstance(acc.finish().exception(), TruncatedStreamError)
    fold(acc, chunk({"content": "a"}, "stop"))
    assert not acc.truncated and not acc.closed
    assert acc.finish().exception() is None
    fold(acc, DONE)
    assert acc.closed and acc.finish().end == "done"
    assert acc.finish().exception() is None

    acc = Accumulator()
    fold(acc, chunk({}, "error", error={"code": 429, "message": "rate limited"}))
    assert acc.closed and not acc.truncated
    exc = acc.finish().exception()
    assert isinstance(exc, MidStreamError)
    assert (exc.message, exc.status, exc.detail) == (
        "rate limited",
        429,
        {"code": 429, "message": "rate limited"},
    )
    assert fold(acc, DONE) == 0 and acc.finish().end == "error"


@pytest.mark.parametrize(
    ("code", "status"),
    [(503, 503), ("503", 503), ("429", 429), ("rate_limit_exceeded", None),
     ("\uff15\uff10\uff13", None), ("5030", None), (True, None), (None, None)],
)  # fmt: skip
def test_a_mid_stream_errors_code_gives_its_status_when_it_is_one(code: Any, status: Any) -> None:
    """LiteLLM sends ``"code": "503"``: a string of three ASCII digits is a status too."""
    acc = Accumulator()
    fold(acc, chunk({}, "error", error={"code": code, "message": "down"}))
    exc = acc.finish().exception()
    assert isinstance(exc, MidStreamError) and exc.status == status


def test_n_choices_end_when_every_choice_has_finished() -> None:
    acc = Accumulator()
    fold(acc, chunk({"content": "a"}, "stop"), chunk({"content": "b"}, index=1))
    assert acc.truncated and acc.finish().end == "truncated"
    fold(acc, chunk({}, "length", index=1))
    assert not acc.truncated and acc.finish().end == "complete"
    fold(acc, chunk({}, "error", index=1))
    assert acc.finish().end == "error"


def test_delta_merge() -> None:
    delta = Delta()
    assert delta.to_json() == {}
    delta.merge({"role": "assistant", "content": "a", "tool_calls": [
        {"index": 0, "id": "c", "function": {"arguments": "x"}}]})  # fmt: skip
    other = Delta(
        role="user",
        content="b",
        tool_calls=[{"index": 0, "id": "d", "function": {"name": "n", "arguments": "y"}}],
        choices=[{"index": 1, "refusal": "no"}],
    )
    delta.merge(other)
    assert delta.to_json() == {
        "role": "assistant",
        "content": "ab",
        "tool_calls": [{"index": 0, "id": "c", "function": {"name": "n", "arguments": "xy"}}],
        "choices": [{"index": 1, "refusal": "no"}],
    }
    assert other["tool_calls"] == [
        {"index": 0, "id": "d", "function": {"name": "n", "arguments": "y"}}
    ]


def test_finish_is_repeatable_and_does_not_alias_state() -> None:
    acc = Accumulator()
    fold(acc, chunk({"reasoning_details": [{"type": "reasoning.text", "text": "a"}]}))
    first = acc.finish()
    first.reasoning[0]["text"] = "changed"
    fold(acc, chunk({"reasoning_details": [{"type": "reasoning.text", "text": "b"}]}))
    assert acc.finish().reasoning == [{"type": "reasoning.text", "text": "ab"}]


def test_chunks_validate_against_schema() -> None:
    for data in (
        chunk({**A, "content": "x", "tool_calls": [tc(0, "c", "f", "{}")]}),
        bare(usage=USAGE),
        chunk({}, "error", error={"code": 502, "message": "m"}, unknown_field=1),
        chunk({"refusal": "no"}, index=2),
    ):
        parsed = ChatCompletionChunk.model_validate_json(data)
        assert parsed.model_dump(exclude_unset=True) == json.loads(data)


# --- what JSON parsers disagree on ----------------------------------------------------------


def test_invalid_json_names_the_bytes() -> None:
    with pytest.raises(ProtocolError, match=r"invalid JSON.*'\{\"choices\": \[oops"):
        fold(Accumulator(), '{"choices": [oops')
    long = "{" + "x" * 5000
    with pytest.raises(ProtocolError) as info:
        fold(Accumulator(), long)
    assert "xxxx" in info.value.message and "…" in info.value.message
    assert len(info.value.message) < 300
    with pytest.raises(ProtocolError):
        fold(Accumulator(), "[DONE] ")  # [DONE] counts only as the whole data field


def test_invalid_utf8_folds_as_replacement_characters() -> None:
    acc = Accumulator()
    acc.fold_all([chunk({"content": "ab"}).encode().replace(b"ab", b"a\xffb")])
    assert acc.finish().content == "a\ufffdb"


def test_lone_surrogates_outside_the_text_are_made_valid_at_once() -> None:
    """Only text fragments may wait for the other half of a pair; an id, a name, an
    unknown key, usage or an extra is valid UTF-8 as soon as it is read."""
    acc = Accumulator()
    fold(
        acc,
        chunk({"tool_calls": [tc(0, "c\ud800", "f\udc00", "{}")]}, usage={"x\ud800": "y\udbff"}),
        chunk({"reasoning_details": [{"type": R, "text": "t", "id": "r\ud800"}]}),
        bare(web_search={"results": ["\ud83d\ude00", "\ud83d"]}, error="bad\udfff"),
    )
    final = acc.finish()
    assert final.tool_calls == [call("c\ufffd", "f\ufffd", "{}")]
    assert final.usage == {"x\ufffd": "y\ufffd"}
    assert final.reasoning == [{"type": R, "text": "t", "id": "r\ufffd"}]
    assert final.extras == {"web_search": {"results": ["😀", "\ufffd"]}}
    assert final.error == {"message": "bad\ufffd"}
    json.dumps(final.__dict__, ensure_ascii=False).encode()  # valid UTF-8 throughout


def c0(delta: Any = None, **choice: Any) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": delta, **choice}]})


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ("[1, 2]", "chunk must be a JSON object"),
        ("null", "chunk must be a JSON object"),
        (json.dumps({"choices": {"0": {}}}), "choices must be a list"),
        (json.dumps({"choices": ["x"]}), "choice must be an object"),
        (json.dumps({"choices": [{"index": -1}]}), "choice index must be a non-negative"),
        (json.dumps({"choices": [{"index": "1"}]}), "choice index must be a non-negative"),
        (json.dumps({"choices": [{"index": True}]}), "choice index must be a non-negative"),
        (c0("hi"), "delta must be an object"),
        (c0({"content": 5}), "content must be a string"),
        (c0({"content": ["a"]}), "content must be a string"),
        (c0({"refusal": {"a": 1}}), "refusal must be a string"),
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
        (c0({"reasoning_details": ["x"]}), "reasoning_details must be a list of objects"),
        (c0({"reasoning_details": [{"type": R, "text": 1}]}), "text must be a string"),
        (c0({"reasoning_details": [{"type": 1}]}), "type must be a string"),
        (c0({"reasoning": {"text": "x"}}), "reasoning must be a string"),
        (c0({}, finish_reason=1), "finish_reason must be a string"),
        (json.dumps({"usage": [1]}), "usage must be an object"),
    ],
)
def test_protocol_errors(data: str, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        fold(Accumulator(), data)


# --- properties ---------------------------------------------------------------------------

TEXT = st.text(alphabet='ab{}"é😀\n', max_size=4)
# mostly reasoning.text, so that runs of joinable fragments (and index changes) are common
REASONING_TYPES = ("reasoning.text",) * 4 + ("reasoning.summary", "reasoning.encrypted")


@st.composite
def reasoning_fragment(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(REASONING_TYPES))
    body_key = {"reasoning.text": "text", "reasoning.summary": "summary"}.get(kind, "data")
    frag: dict[str, Any] = {"type": kind, body_key: draw(TEXT)}
    for key, values in (
        ("index", st.sampled_from([0, 1])),
        ("signature", st.sampled_from(["s1", "s2"])),
        ("format", TEXT),
    ):
        if draw(st.integers(0, 3)) == 0:
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
        "refusal": TEXT | st.none(),
        "reasoning_details": st.lists(reasoning_fragment(), max_size=3),
        "reasoning": TEXT | st.none(),
        "tool_calls": st.lists(TOOL_FRAGMENT, max_size=3),
    },
)
CHOICE = st.tuples(st.sampled_from([0, 0, 0, 1, 2]), DELTA)


def choice_chunk(index: int, delta: dict[str, Any]) -> bytes:
    return json.dumps({"id": "g", "model": "m", "choices": [{"index": index, "delta": delta}]},
                      ensure_ascii=False).encode()  # fmt: skip


def publish_each(choices: list[tuple[int, dict[str, Any]]]) -> tuple[Accumulator, list[Delta]]:
    acc, published = Accumulator(), []
    for index, delta in choices:
        acc.fold_all([choice_chunk(index, delta)])
        taken = acc.take_delta()
        if taken is not None:
            published.append(taken)
    return acc, published


@settings(max_examples=1000, deadline=None)
@given(choices=st.lists(CHOICE, max_size=12), data=st.data())
def test_coalesced_deltas_merge_to_the_final_message(
    choices: list[tuple[int, dict[str, Any]]], data: st.DataObject
) -> None:
    """Published deltas coalesced in arbitrary consecutive groups (``Delta.merge``, as the
    publisher does), then merged in order, give the final message."""
    acc, published = publish_each(choices)
    groups = []
    i = 0
    while i < len(published):
        size = data.draw(st.integers(1, 4))
        group = Delta(json.loads(json.dumps(published[i])))
        for later in published[i + 1 : i + size]:
            group.merge(later)
        groups.append(group)
        i += size
    final = acc.finish()
    assert output_of(merged(groups)) == output_of(final)
    assert all(published) and all(
        isinstance(value, list | str) for d in published for value in d.values()
    )


@settings(max_examples=500, deadline=None)
@given(choices=st.lists(CHOICE, max_size=12), cut=st.data())
def test_merging_is_associative(
    choices: list[tuple[int, dict[str, Any]]], cut: st.DataObject
) -> None:
    """(a + b) + c == a + (b + c) for consecutive published deltas: any grouping merges
    to the same delta."""
    _, published = publish_each(choices)
    one_by_one = merged(published).data
    at = cut.draw(st.integers(0, len(published)))
    left, right = Delta(), Delta()
    for delta in published[:at]:
        left.merge(delta)
    for delta in published[at:]:
        right.merge(delta)
    left.merge(right)
    assert left == one_by_one


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
                    "refusal",
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
                    "signature",
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
            fold(acc, json.dumps(value))
        delta = acc.take_delta()
        json.dumps(delta, ensure_ascii=False).encode()  # publishable: valid UTF-8
    final = acc.finish()
    json.dumps(final.__dict__, ensure_ascii=False).encode()


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(max_size=20), max_size=5))
def test_arbitrary_text_raises_only_protocol_error(texts: list[str]) -> None:
    acc = Accumulator()
    for text in texts:
        with contextlib.suppress(ProtocolError):
            acc.fold_all([text.encode("utf-8", "surrogatepass")])
    acc.finish()


def test_deep_nesting_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        fold(Accumulator(), "[" * 100_000)
