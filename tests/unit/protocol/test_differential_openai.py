"""Differential test: the official ``openai`` SDK's stream accumulation against ours.

The same SSE bytes go through the SDK (``client.chat.completions.stream()`` over a mock
transport: its SSE decoder, ``[DONE]`` handling and ``ChatCompletionStreamState``) and
through ``SSEDecoder.feed_data`` + ``Accumulator.fold_all`` / ``take_delta`` (what the
pipeline runs). On valid streams every choice's content, refusal, tool calls (id, name,
arguments), reasoning text and finish_reason, and the usage, must agree; so must the
published deltas merged by ``Delta.merge``.

Where the SDK deviates from the protocol (seeds + OpenAI/OpenRouter behaviour), the
``test_sdk_deviation_*`` tests pin the SDK's behaviour in a comment and an assertion, and
assert ours.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx2
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.checks import merged, output_of
from worker.errors import ProtocolError
from worker.protocol.accumulator import Accumulator, FinalMessage
from worker.protocol.sse import SSEDecoder

USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, index: int = 0, **top: Any
) -> str:
    """A chunk as JSON text (``json.dumps``: lone surrogates become ``\\u`` escapes)."""
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1751299200,
        "model": "gpt-test",
        "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}],
    }
    body.update(top)
    return json.dumps(body)


def usage_chunk(usage: dict[str, Any] | None = USAGE) -> str:
    return json.dumps(
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1751299200,
         "model": "gpt-test", "choices": [], "usage": usage}
    )  # fmt: skip


def sse(datas: list[str], *, eol: str = "\n") -> bytes:
    return "".join(f"data: {d}{eol}{eol}" for d in datas).encode()


Summary = dict[str, Any]


def utf16(text: Any) -> Any:
    """What a UTF-16 client reads from the SDK's concatenated strings (JavaScript, or
    ``str`` made valid): a surrogate pair split across chunks is one character, a lone
    surrogate is U+FFFD. The SDK itself keeps the two halves as two code points."""
    if not isinstance(text, str):
        return text  # the SDK keeps an arguments object as it is (a deviation, below)
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def sdk_summary(body: bytes) -> Summary:
    """Run ``body`` through the official SDK's streaming helper; the comparable fields."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    client = openai.OpenAI(
        api_key="sk-test", base_url="http://upstream.test/v1", http_client=http, max_retries=0
    )
    with (
        client,
        client.chat.completions.stream(
            model="gpt-test", messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        completion = stream.get_final_completion()
    first, *others = [sdk_choice(choice) for choice in completion.choices]
    usage = completion.usage.to_dict() if completion.usage else None
    return {**first, "choices": others, "usage": usage}


def sdk_choice(choice: Any) -> Summary:
    message = choice.message
    extra = message.model_extra or {}
    return {
        "index": choice.index,
        "role": message.role,
        "content": utf16(message.content or ""),
        "refusal": utf16(message.refusal or ""),
        "tool_calls": [
            (t.id, t.function.name, utf16(t.function.arguments)) for t in message.tool_calls or []
        ],
        "reasoning": utf16(extra.get("reasoning") or ""),
        "finish_reason": choice.finish_reason,
    }


def ours(body: bytes, read_size: int = 0) -> FinalMessage:
    """What the pipeline does: SSEDecoder.feed_data per read, fold_all, take_delta; the
    taken deltas must merge (Delta.merge) to the final message."""
    decoder, acc, taken = SSEDecoder(), Accumulator(), []
    reads = (
        [body[i : i + read_size] for i in range(0, len(body), read_size)] if read_size else [body]
    )
    try:
        for read in reads:
            try:
                acc.fold_all(decoder.feed_data(read))
            finally:  # as the pipeline: what was folded before an error is published
                if (delta := acc.take_delta()) is not None:
                    taken.append(json.loads(json.dumps(delta)))
    finally:
        final = acc.finish()
        assert output_of(merged(taken)) == output_of(final)
    return final


def our_summary(final: FinalMessage) -> Summary:
    first = our_choice({"index": 0, **vars(final)})
    others = [our_choice(choice) for choice in final.choices or []]
    return {**first, "choices": others, "usage": final.usage}


def our_choice(choice: dict[str, Any]) -> Summary:
    return {
        "index": choice["index"],
        "role": choice["role"],
        "content": choice["content"],
        "refusal": choice["refusal"],
        "tool_calls": [
            (t["id"], t["function"]["name"], t["function"]["arguments"])
            for t in choice["tool_calls"]
        ],
        "reasoning": "".join(r.get("text", "") for r in choice["reasoning"]),
        "finish_reason": choice["finish_reason"],
    }


def assert_same(datas: list[str], *, eol: str = "\n", read_size: int = 0) -> FinalMessage:
    body = sse(datas, eol=eol)
    final = ours(body, read_size)
    assert our_summary(final) == sdk_summary(body)
    return final


A = {"role": "assistant"}
FN_F_ARGS = {"name": "f", "arguments": "{}"}


def call_start(index: int, id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def args(index: int, text: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": text}}


STREAMS: list[Any] = [
    pytest.param(
        [
            chunk({**A, "content": "Sealed "}),
            chunk({"content": "and private"}),
            chunk(finish="stop"),
            "[DONE]",
        ],
        id="seed-text",
    ),
    pytest.param(
        [
            chunk({**A, "content": "A gateway"}),
            chunk({"content": " is a single entry point."}),
            chunk(finish="stop"),
            usage_chunk(),
            "[DONE]",
        ],
        id="text-with-usage-chunk",
    ),
    pytest.param(
        [
            chunk({**A, "content": ""}),
            chunk({"content": "say [DONE]"}),
            chunk({"content": "[DONE]"}),
            chunk({"content": "\n\ndata: [DONE]\n\n"}),
            chunk(finish="stop"),
            usage_chunk(),
            "[DONE]",
        ],
        id="content-containing-done",
    ),
    pytest.param(
        [
            chunk({**A, "content": 'Zürich ☃ 😀 \u2028 "quoted" \\ back'}),
            chunk(finish="stop"),
            "[DONE]",
        ],
        id="unicode",
    ),
    pytest.param(
        [
            chunk({**A, "content": None, "tool_calls": [call_start(0, "call_a", "get_weather")]}),
            chunk({"tool_calls": [args(0, '{"city":')]}),
            chunk({"tool_calls": [call_start(1, "call_b", "get_time")]}),
            chunk({"tool_calls": [args(1, '{"tz":"CET"}')]}),
            chunk({"tool_calls": [args(0, '"Paris"}')]}),
            chunk(finish="tool_calls"),
            usage_chunk(),
            "[DONE]",
        ],
        id="parallel-tool-calls",
    ),
    pytest.param(
        [
            chunk({**A, "content": "Let me check."}),
            chunk({"tool_calls": [call_start(0, "call_a", "f"), args(0, "{}")]}),
            chunk(finish="tool_calls", usage=USAGE),
            "[DONE]",
        ],
        id="content-then-tool-call-usage-on-last-chunk",
    ),
    pytest.param(
        [
            chunk({**A, "reasoning": "Think"}),
            chunk({"reasoning": "ing..."}),
            chunk({"content": "Answer"}),
            chunk(finish="stop"),
            "[DONE]",
        ],
        id="openrouter-reasoning-string",
    ),
]


@pytest.mark.parametrize("datas", STREAMS)
def test_same_result_as_official_sdk(datas: list[str]) -> None:
    assert_same(datas)


def test_keep_alive_comments_and_crlf() -> None:
    datas = [chunk({**A, "content": "a"}), chunk({"content": "b"}), chunk(finish="stop"), "[DONE]"]
    body = b": OPENROUTER PROCESSING\r\n\r\n" + sse(datas, eol="\r\n")
    assert our_summary(ours(body)) == sdk_summary(body)
    assert ours(body).content == "ab"


FRAGMENT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
EMOJI_TEXT = st.text(alphabet=st.sampled_from(["a", "é", "😀", "🚀", "𝄞", " "]), max_size=8)


@st.composite
def split_utf16(draw: st.DrawFn, text: str) -> list[str]:
    """``text`` cut at any UTF-16 code units, as a gateway that splits by code units
    does: a cut inside a pair leaves a lone surrogate at each side."""
    units = text.encode("utf-16-le", "surrogatepass")
    cuts = sorted(draw(st.sets(st.integers(0, len(units) // 2), max_size=4)))
    bounds = [0, *cuts, len(units) // 2]
    return [
        units[2 * a : 2 * b].decode("utf-16-le", "surrogatepass")
        for a, b in itertools.pairwise(bounds)
    ]


@st.composite
def choice_chunks(draw: st.DrawFn, index: int, openai_trailers: bool) -> list[dict[str, Any]]:
    """One choice's chunks, OpenAI-shaped: text (pairs split by code units), a refusal,
    parallel tool calls, a finish_reason."""
    out: list[dict[str, Any]] = [{**A, "content": "", "refusal": None}]
    for text in draw(st.lists(EMOJI_TEXT | FRAGMENT, max_size=3)):
        out += [{"content": piece} for piece in draw(split_utf16(text))]
    if draw(st.integers(0, 3)) == 0:
        out += [{"refusal": piece} for piece in draw(split_utf16(draw(EMOJI_TEXT)))]
    calls = draw(st.integers(0, 2))
    for call in range(calls):
        out.append({"tool_calls": [call_start(call, f"call_{index}_{call}", f"fn{call}")]})
    for call, text in draw(st.lists(st.tuples(st.integers(0, 1), EMOJI_TEXT), max_size=4)):
        if call < calls:
            out += [{"tool_calls": [args(call, piece)]} for piece in draw(split_utf16(text))]
    out.append({"finish": "tool_calls" if calls else "stop"})
    return out


@st.composite
def valid_stream(draw: st.DrawFn) -> list[str]:
    """OpenAI-shaped streams with n choices whose chunks interleave, optionally with
    ``"usage": null`` and ``obfuscation`` on every chunk, and a usage chunk."""
    trailers = draw(st.booleans())
    pending = [draw(choice_chunks(index, trailers)) for index in range(draw(st.integers(1, 3)))]
    datas: list[str] = []
    order = list(range(len(pending)))  # each choice first appears in index order (the SDK
    while any(pending):  # needs that: see test_sdk_deviation_choice_1_first_fails)
        index = (
            order.pop(0)
            if order
            else draw(st.sampled_from([i for i, p in enumerate(pending) if p]))
        )
        delta = pending[index].pop(0)
        top = {"usage": None, "obfuscation": draw(st.text("aZ09", max_size=8))} if trailers else {}
        finish = delta.pop("finish", None)
        datas.append(chunk(delta, finish, index, **top))
    if draw(st.booleans()):
        datas.append(usage_chunk())
    return [*datas, "[DONE]"]


@settings(max_examples=100, deadline=None)
@given(datas=valid_stream(), read_size=st.sampled_from([0, 1, 7, 300]))
def test_random_valid_streams_match_official_sdk(datas: list[str], read_size: int) -> None:
    assert assert_same(datas, read_size=read_size).end == "done"


# --- where the official SDK deviates --------------------------------------------------------


def test_sdk_deviation_repeated_role_is_concatenated() -> None:
    # SDK: accumulate_delta concatenates every string field, so a role repeated on each
    # chunk (some providers do) becomes "assistantassistant". Ours: role is set once.
    datas = [
        chunk({**A, "content": "a"}),
        chunk({**A, "content": "b"}),
        chunk(finish="stop"),
        "[DONE]",
    ]
    assert sdk_summary(sse(datas))["role"] == "assistantassistant"
    final = ours(sse(datas))
    assert (final.role, final.content) == ("assistant", "ab")


def test_sdk_deviation_repeated_id_and_name_are_concatenated() -> None:
    # SDK: id and function.name repeated on later fragments are concatenated
    # ("call_1call_1", "ff"). Ours: id/type/name keep the first non-empty value.
    datas = [
        chunk({**A, "tool_calls": [call_start(0, "call_1", "f")]}),
        chunk({"tool_calls": [{**call_start(0, "call_1", "f"), "function": FN_F_ARGS}]}),
        chunk(finish="tool_calls"),
        "[DONE]",
    ]  # fmt: skip
    assert sdk_summary(sse(datas))["tool_calls"] == [("call_1call_1", "ff", "{}")]
    assert our_summary(ours(sse(datas)))["tool_calls"] == [("call_1", "f", "{}")]


def test_sdk_deviation_fragment_without_index_fails() -> None:
    # SDK: a tool-call fragment without "index" raises RuntimeError ("Expected list delta
    # entry to have an `index` key"). Ours: it joins the call with the same id, else the last.
    datas = [
        chunk({**A, "tool_calls": [call_start(0, "call_1", "f")]}),
        chunk({"tool_calls": [{"function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"id": "call_1", "function": {"arguments": "1}"}}]}),
        chunk(finish="tool_calls"),
        "[DONE]",
    ]
    with pytest.raises(RuntimeError, match="index"):
        sdk_summary(sse(datas))
    assert our_summary(ours(sse(datas)))["tool_calls"] == [("call_1", "f", '{"a":1}')]


def test_sdk_deviation_first_call_with_index_1_fails() -> None:
    # SDK: a first tool call with index 1 is inserted at list position 0, so its next
    # fragment (index 1) hits IndexError. Ours: calls are keyed by index.
    datas = [
        chunk(A),
        chunk({"tool_calls": [call_start(1, "call_1", "f")]}),
        chunk({"tool_calls": [args(1, "{}")]}),
        chunk(finish="tool_calls"),
        "[DONE]",
    ]
    with pytest.raises(IndexError):
        sdk_summary(sse(datas))
    assert our_summary(ours(sse(datas)))["tool_calls"] == [("call_1", "f", "{}")]


def test_sdk_deviation_later_null_usage_erases_usage() -> None:
    # SDK: completion.usage is replaced by every chunk's usage, so a chunk with
    # "usage": null after the usage chunk erases it. Ours: the last non-null usage wins.
    datas = [chunk({**A, "content": "a"}), chunk(finish="stop"), usage_chunk(),
             chunk({}, usage=None), "[DONE]"]  # fmt: skip
    assert sdk_summary(sse(datas))["usage"] is None
    assert ours(sse(datas)).usage == USAGE


def test_sdk_deviation_done_prefix_ends_the_stream() -> None:
    # SDK: any data field that merely starts with "[DONE]" ends the stream silently
    # (later chunks are dropped). Ours: "[DONE]" counts only as the whole data field;
    # anything else must be JSON, so "[DONE]x" is a ProtocolError.
    datas = [
        chunk({**A, "content": "a"}),
        "[DONE]x",
        chunk({"content": "b"}),
        chunk(finish="stop"),
        "[DONE]",
    ]
    assert sdk_summary(sse(datas))["content"] == "a"
    with pytest.raises(ProtocolError, match=r"\[DONE\]x"):
        ours(sse(datas))


def test_sdk_deviation_mid_stream_error_loses_partial_output() -> None:
    # SDK: a chunk with a top-level error raises APIError; the partial output is lost to
    # the caller. Ours: the error is recorded, the partial output kept, end == "error".
    datas = [
        chunk({**A, "content": "partial"}),
        chunk({}, "error", error={"code": 502, "message": "boom"}),
    ]
    with pytest.raises(openai.APIError, match="boom"):
        sdk_summary(sse(datas))
    final = ours(sse(datas))
    assert (final.end, final.content, final.error) == (
        "error",
        "partial",
        {"code": 502, "message": "boom"},
    )


def test_sdk_deviation_arguments_object_not_serialised() -> None:
    # SDK: "arguments" sent as a JSON object stays a dict (with a pydantic serializer
    # warning), and a dict fragment after a string one is dropped. Ours: compact JSON string.
    whole = {**call_start(0, "c", "f"), "function": {"name": "f", "arguments": {"a": 1}}}
    first = [chunk({**A, "tool_calls": [whole]}),
             chunk(finish="tool_calls"), "[DONE]"]  # fmt: skip
    later = [chunk({**A, "tool_calls": [call_start(0, "c", "f")]}),
             chunk({"tool_calls": [{"index": 0, "function": {"arguments": {"a": 1}}}]}),
             chunk(finish="tool_calls"), "[DONE]"]  # fmt: skip
    with pytest.warns(UserWarning, match="serializ"):
        assert sdk_summary(sse(first))["tool_calls"] == [("c", "f", {"a": 1})]
    with pytest.warns(UserWarning, match="serializ"):
        assert sdk_summary(sse(later))["tool_calls"] == [("c", "f", "")]
    for datas in (first, later):
        assert our_summary(ours(sse(datas)))["tool_calls"] == [("c", "f", '{"a":1}')]


def test_sdk_deviation_truncation_not_detected() -> None:
    # SDK: a stream that ends with neither [DONE] nor a finish_reason yields a normal
    # completion (finish_reason None). Ours: end == "truncated" (retryable).
    datas = [chunk({**A, "content": "cut"})]
    assert sdk_summary(sse(datas))["content"] == "cut"
    final = ours(sse(datas))
    assert (final.end, final.content) == ("truncated", "cut")


def test_sdk_deviation_reasoning_details_without_index_fail() -> None:
    # SDK: reasoning_details fragments without "index" (OpenRouter sends them so) raise
    # RuntimeError on the second chunk. Ours: consecutive same-type fragments merge.
    frag = {"type": "reasoning.text", "text": "a"}
    datas = [chunk({**A, "reasoning_details": [frag]}), chunk({"reasoning_details": [frag]}),
             chunk(finish="stop"), "[DONE]"]  # fmt: skip
    with pytest.raises(RuntimeError, match="index"):
        sdk_summary(sse(datas))
    assert ours(sse(datas)).reasoning == [{"type": "reasoning.text", "text": "aa"}]


def test_sdk_deviation_length_finish_raises() -> None:
    # SDK: the .stream() helper's get_final_completion() raises LengthFinishReasonError on
    # finish_reason "length" (even without a response_format), losing the output.
    # Ours: a normal result with finish_reason "length".
    datas = [chunk({**A, "content": "long"}), chunk(finish="length"), "[DONE]"]
    with pytest.raises(openai.LengthFinishReasonError):
        sdk_summary(sse(datas))
    final = ours(sse(datas))
    assert (final.end, final.finish_reason, final.content) == ("done", "length", "long")


def test_sdk_deviation_choice_1_first_fails() -> None:
    # SDK: a choice whose first chunk comes before a lower index's is written at a list
    # position that does not exist yet: IndexError. Ours: choices are keyed by index.
    datas = [chunk({**A, "content": "b"}, index=1), chunk({**A, "content": "a"}),
             chunk(finish="stop"), chunk(finish="stop", index=1), "[DONE]"]  # fmt: skip
    with pytest.raises(IndexError):
        sdk_summary(sse(datas))
    final = ours(sse(datas))
    assert (final.content, final.choices) == ("a", [{"index": 1, "role": "assistant",
        "content": "b", "refusal": "", "reasoning": [], "tool_calls": [],
        "finish_reason": "stop"}])  # fmt: skip


def test_sdk_deviation_split_surrogate_pair_kept_as_two_halves() -> None:
    # SDK: a pair split across chunks as escapes ("\ud83d", "\ude00") is concatenated as
    # two code points, which Python cannot encode as UTF-8. Ours: one character.
    datas = [chunk({**A, "content": "a\ud83d"}), chunk({"content": "\ude00"}),
             chunk(finish="stop"), "[DONE]"]  # fmt: skip
    assert sdk_summary(sse(datas))["content"] == "a😀"  # after utf16()
    assert ours(sse(datas)).content == "a😀"
    with pytest.raises(UnicodeEncodeError):
        ("a\ud83d" + "\ude00").encode()
