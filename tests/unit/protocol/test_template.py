"""Chunk templates: a matched chunk folds exactly as the parsed chunk would.

The subject is the Accumulator fed raw bytes through ``fold_all``, as the pipeline does;
the reference is the same Accumulator with learning switched off (every chunk parsed).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.checks import merged
from worker.errors import ChatstreamError
from worker.protocol.accumulator import Accumulator, FinalMessage
from worker.protocol.template import ChunkTemplate, learn

DELTA = ("choices", 0, "delta")
CONTENT = (*DELTA, "content")
IGNORED = ((*DELTA, "reasoning"),)
RANDOM = (("obfuscation",),)


class Parsing(Accumulator):
    """The reference: the same accumulator, its templates never learned."""

    def _learn(self, *_: Any) -> None:
        pass


def envelope(
    delta: dict[str, Any], index: int = 0, *, finish_reason: str | None = None, **top: Any
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"id": "gen-1", "object": "chat.completion.chunk", "created": 1751299200,
            "model": "m", "choices": [choice], **top}  # fmt: skip


def raw(body: dict[str, Any], *, spaced: bool = False, ascii_only: bool = False) -> bytes:
    """``body`` as JSON in UTF-8; a lone surrogate (half of a split pair) as an escape."""
    separators = (", ", ": ") if spaced else (",", ":")
    text = json.dumps(body, separators=separators, ensure_ascii=ascii_only)
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m[0]):04x}", text).encode()


def template_of(body: dict[str, Any]) -> ChunkTemplate[None]:
    data = raw(body)
    template = learn(data, json.loads(data), CONTENT, IGNORED, RANDOM, None)
    assert template is not None
    return template


# --- match ------------------------------------------------------------------------------


def test_match_returns_the_hole_value() -> None:
    template = template_of(envelope({"content": "Hello"}))
    assert template.match(raw(envelope({"content": " world, 東京 🙂"}))) == " world, 東京 🙂"


@pytest.mark.parametrize(
    "value",
    ['say "hi"', "back\\slash", "line\nbreak", "tab\t", "nul\x00", "\u2028", "\x7f", '{"a": 1}'],
)
def test_escaped_values_match_as_the_parser_reads_them(value: str) -> None:
    template = template_of(envelope({"content": "Hello"}))
    for ascii_only in (False, True):
        assert template.match(raw(envelope({"content": value}), ascii_only=ascii_only)) == value


@pytest.mark.parametrize(
    ("hole", "why"),
    [
        (b"", "empty"),
        (b"a\nb", "a raw line feed"),
        (b"a\x00b", "a raw NUL"),
        (b"a\\qb", "an invalid escape"),
        (b"a\\", "a backslash escaping the closing quote"),
        (b'a","x":"b', "structure inside the hole"),
        (b"a\xffb", "invalid UTF-8 (the parser's U+FFFD path decides)"),
    ],
)
def test_holes_that_are_not_one_valid_string_do_not_match(hole: bytes, why: str) -> None:
    template = template_of(envelope({"content": "Hello"}))
    assert template.match(raw(envelope({"content": "Hello"})).replace(b"Hello", hole)) is None, why


def test_other_changes_do_not_match() -> None:
    template = template_of(envelope({"content": "Hello"}))
    for body in (
        envelope({"content": "x"}, created=1751299201),
        envelope({"content": "x", "role": "assistant"}),
        envelope({"content": "x"}, usage={"total_tokens": 1}),
        {**envelope({"content": "x"}), "model": "other"},
    ):
        assert template.match(raw(body)) is None
    assert template.match(raw(envelope({"content": "x"}), spaced=True)) is None
    assert template.match(b"[DONE]") is None
    assert template.match(raw(envelope({"content": "x"}))[:-1]) is None


def test_invalid_utf8_is_left_to_the_parser() -> None:
    template = template_of(envelope({"content": "Hello"}))
    data = raw(envelope({"content": "ab"})).replace(b"ab", b"a\xffb")
    assert template.match(data) is None


def test_ignored_fields_may_change() -> None:
    template = template_of(envelope({"content": "Hello"}, obfuscation="k3J"))
    assert template.match(raw(envelope({"content": "x"}, obfuscation="Zq9a0"))) == "x"
    assert template.match(raw(envelope({"content": "x"}, obfuscation="q\\/"))) == "x"
    assert template.match(raw(envelope({"content": "x"}, obfuscation='q"'))) is None  # parsed
    assert template.match(raw(envelope({"content": 'x"\\"'}, obfuscation="q"))) == 'x"\\"'
    assert template.match(raw(envelope({"content": "x"}, obfuscation="q\n"))) == "x"
    for hole in (b'q"', b"q\\", b"q\\x", b"q\n"):  # not one valid JSON string
        data = raw(envelope({"content": "x"}, obfuscation="q")).replace(b'"q"', b'"' + hole + b'"')
        assert template.match(data) is None, hole
    data = raw(envelope({"content": "x"}, obfuscation="q")).replace(b'"q"', b'""')
    assert template.match(data) == "x"  # an empty ignored string is a string


def test_linked_holes_must_stay_equal_unlinked_may_differ() -> None:
    path = (*DELTA, "reasoning_details", 0, "text")

    def body(reasoning: str, text: str) -> dict[str, Any]:
        detail = {"type": "reasoning.text", "text": text, "index": 0}
        return envelope({"reasoning": reasoning, "reasoning_details": [detail]})

    linked = learn(raw(body("a", "a")), body("a", "a"), path, IGNORED, RANDOM, None)
    unlinked = learn(raw(body("a", "b")), body("a", "b"), path, IGNORED, RANDOM, None)
    assert linked is not None and unlinked is not None
    assert linked.match(raw(body("xy", "xy"))) == "xy"
    assert linked.match(raw(body("x", "yz"))) is None
    assert unlinked.match(raw(body("x", "yz"))) == "yz"
    assert unlinked.match(raw(body('x"', 'y"z\\'))) == 'y"z\\'  # escapes end no hole
    assert unlinked.match(raw(body("x", "y\n"))) == "y\n"
    assert linked.match(raw(body('x"y', 'x"y'))) == 'x"y'


def test_a_random_field_is_never_linked() -> None:
    """OpenAI's obfuscation may equal the token once; the template must not require it."""
    template = template_of(envelope({"content": "ab"}, obfuscation="ab"))
    assert template.match(raw(envelope({"content": "x"}, obfuscation="yz"))) == "x"


def test_a_linked_hole_cannot_swallow_structure() -> None:
    """Equal slices at computed positions are still refused when they hold a quote."""
    path = (*DELTA, "reasoning_details", 0, "text")
    body = envelope({"reasoning": "a", "reasoning_details": [{"type": "t", "text": "a"}]})
    template = learn(raw(body), body, path, IGNORED, RANDOM, None)
    assert template is not None
    sneaky = raw(body).replace(b'"a"', b'"a","zz":"b"')
    assert json.loads(sneaky)["choices"][0]["delta"]["reasoning"] == "a"
    assert template.match(sneaky) is None


# --- learn ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (raw(envelope({"content": "m"})), "the value is also the model name"),
        (raw(envelope({"content": "index"})), "the value is also a key"),
        (raw(envelope({"content": 'a"b'})), "an escaped value"),
        (raw(envelope({"content": "é"}), ascii_only=True), "a \\u escape"),
        (raw(envelope({"content": ""})), "an empty value"),
        (b'{"choices":[{"delta":{"content":"x","content":"x"}}]}', "a duplicate key"),
        (raw(envelope({"content": "x", "tag": "a\\b"})), "a backslash in the literals"),
    ],
)
def test_learn_refuses_what_it_cannot_prove(data: bytes, why: str) -> None:
    parsed = json.loads(data)
    assert learn(data, parsed, CONTENT, IGNORED, RANDOM, None) is None, why


def test_learn_refuses_a_chunk_that_does_not_parse_to_the_claimed_value() -> None:
    data = raw(envelope({"content": "x"}))
    claimed = json.loads(raw(envelope({"content": "y"})))
    assert learn(data, claimed, CONTENT, (), (), None) is None


# --- the accumulator with templates -----------------------------------------------------


def text(value: str, **top: Any) -> bytes:
    return raw(envelope({"content": value}, **top))


def test_the_template_is_dropped_at_done_and_at_an_error() -> None:
    for end in (b"[DONE]", raw({"error": {"message": "boom"}, "choices": []})):
        acc = Accumulator()
        acc.fold_all([text("a"), text("b"), text("c"), end, text("d")])
        assert acc.finish().content == "abc"


def test_a_reasoning_template_does_not_outlive_its_entry() -> None:
    def thought(kind: str, value: str) -> bytes:
        detail = {"type": kind, "text": value, "index": 0}
        return raw(envelope({"content": "", "reasoning_details": [detail]}))

    acc = Accumulator()
    acc.fold_all([thought("reasoning.text", v) for v in ("a", "b", "c")])
    acc.fold_all([thought("reasoning.summary", 'x"y')])  # parsed: no template of its own
    acc.fold_all([thought("reasoning.text", v) for v in ("d", "e")])
    assert [entry["text"] for entry in acc.finish().reasoning] == ["abc", 'x"y', "de"]


def test_a_reasoning_template_stops_at_a_signature() -> None:
    """A signature ends its block: chunks of the template's shape after it start a new
    entry (the template is dropped and the chunk parsed), as parsing alone would."""

    def thought(value: str, signature: str | None = None) -> bytes:
        detail = {"type": "reasoning.text", "text": value, "signature": signature}
        return raw(envelope({"content": "", "reasoning_details": [detail]}))

    for acc in (Accumulator(), Parsing()):
        acc.fold_all([thought(v) for v in ("a", "b", "c")])
        acc.fold_all([thought(" end", "sig-1")])
        acc.fold_all([thought(v) for v in ("d", "e")])
        assert [(e["text"], e.get("signature")) for e in acc.finish().reasoning] == [
            ("abc end", "sig-1"),
            ("de", None),
        ]


def test_a_stream_whose_chunks_never_repeat_rations_learning() -> None:
    acc = Accumulator()
    chunks = [text(f"w{i}", created=i) for i in range(400)]
    assert acc.fold_all(chunks) == 400
    assert acc.finish().content == "".join(f"w{i}" for i in range(400))
    assert acc._learns <= 8 + 400 // 256


def test_a_repetitive_stream_is_folded_without_parsing() -> None:
    acc = Accumulator()
    acc.fold_all([text(f" w{i}") for i in range(500)])
    assert acc._parsed <= 2
    assert acc.finish().content == "".join(f" w{i}" for i in range(500))


# --- differential property --------------------------------------------------------------

CLEAN = st.text(
    alphabet=st.sampled_from(["a", " ", "é", "東", "🙂", "~", "0", "{", ":"]), max_size=4
)
VALUES = st.one_of(
    CLEAN,
    CLEAN,
    CLEAN,
    st.text(
        alphabet=st.sampled_from(["a", '"', "\\", "\n", "\x00", "\u2028", "\x7f"]),
        max_size=3,
    ),
    st.sampled_from(["content", "index", "m", "gen-1", "function", "reasoning.text", "~0~"]),
    st.sampled_from(["\ud83d", "\ude00", "a\ud83d", "\ude00b", "\udfff"]),  # split pairs, lone
)
TRAILERS = st.sampled_from([{}, {"usage": None}, {"usage": None, "error": None},
                            {"web_search": None, "free_tier": None}])  # fmt: skip


@st.composite
def runs(draw: st.DrawFn) -> list[bytes]:
    """A run of chunks of one shape (as providers send them), values varying; or one
    chunk of anything else."""
    kind = draw(st.sampled_from(["text", "args", "reasoning", "refusal", "other"]))
    ascii_only = draw(st.integers(0, 4)) == 0
    obfuscate = draw(st.integers(0, 3)) == 0
    trailers = draw(TRAILERS)
    role = {"role": "assistant"} if draw(st.booleans()) else {}  # OpenRouter: every chunk
    index, choice = draw(st.sampled_from([0, 1])), draw(st.sampled_from([0, 0, 0, 1]))
    kind_of_reasoning = draw(st.sampled_from(["reasoning.text", "reasoning.summary"]))
    duplicated = draw(st.sampled_from(["same", "other", "absent"]))
    signed = draw(st.sampled_from([None, None, "s1", "s2"]))
    out: list[bytes] = []
    for value in draw(st.lists(VALUES, min_size=1, max_size=12)):
        top = {"obfuscation": draw(VALUES)} if obfuscate else {}
        if kind == "text":
            delta: dict[str, Any] = {**role, "content": value}
        elif kind == "refusal":
            delta = {"refusal": value}
        elif kind == "args":
            frag: dict[str, Any] = {"index": index, "function": {"arguments": value}}
            if not out:  # the run opens the call
                frag.update(id=f"call_{index}", type="function")
                frag["function"]["name"] = "f"
            delta = {"tool_calls": [frag]}
        elif kind == "reasoning":
            key = "text" if kind_of_reasoning == "reasoning.text" else "summary"
            detail = {"type": kind_of_reasoning, key: value, "format": "unknown",
                      "index": index, "signature": signed if len(out) == 11 else None}  # fmt: skip
            delta = {**role, "content": "", "reasoning_details": [detail]}
            if duplicated != "absent":
                delta["reasoning"] = value if duplicated == "same" else draw(VALUES)
        else:
            other = draw(st.sampled_from(OTHER))
            return [other.replace(b"VALUE", json.dumps(value)[1:-1].encode())]
        out.append(raw(envelope(delta, choice, **top, **trailers), ascii_only=ascii_only))
    return out


OTHER = [
    b"[DONE]",
    b"{broken",
    b"",
    raw({"error": {"message": "boom"}, "choices": []}),
    raw(envelope({"role": "assistant", "content": "VALUE"})),
    raw(envelope({"content": "VALUE"})).replace(b'"content":"', b'"content":"\xff', 1),
    raw(envelope({"content": "VALUE"})).replace(b'"content"', b'"content":"dup","content"', 1),
    raw(envelope({"content": "VALUE"}, usage={"total_tokens": 3})),
    raw(envelope({"content": "VALUE"}, created=1)),
    raw(envelope({}, finish_reason="stop")),
    raw(envelope({"content": "VALUE"}, error={"message": "boom"})),
]


def fold_each(acc: Accumulator, fields: list[bytes], takes: list[bool]) -> tuple[Any, ...]:
    """Fold every field, taking deltas where ``takes`` says; the outcome to compare."""
    published, error = [], None
    for field, take in zip(fields, takes, strict=True):
        try:
            acc.fold_all([field])
        except ChatstreamError as exc:
            error = (type(exc), str(exc))
            break
        finally:
            if take and (delta := acc.take_delta()) is not None:
                published.append(json.loads(json.dumps(delta)))
    last = acc.take_delta()
    if last is not None:
        published.append(last)
    message: FinalMessage = acc.finish()
    return message, error, merged(published).data


@settings(max_examples=400, deadline=None)
@given(st.lists(runs(), max_size=8), st.data())
def test_templates_fold_exactly_as_parsing(groups: list[list[bytes]], data: st.DataObject) -> None:
    fields = [field for group in groups for field in group]
    takes = data.draw(st.lists(st.booleans(), min_size=len(fields), max_size=len(fields)))
    head = raw(envelope({"role": "assistant", "content": ""}))
    subject = fold_each(Accumulator(), [head, *fields], [False, *takes])
    reference = fold_each(Parsing(), [head, *fields], [False, *takes])
    assert subject == reference
