"""The gateway's one entry id parser, fed every odd form a client can send."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.gateway.cursors import MAX_PART, BadCursor, parse_entry_id, resume_after

REDIS_ID = re.compile(r"(0|[1-9][0-9]{0,19})-(0|[1-9][0-9]{0,19})")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-0", (0, 0)),
        ("0", (0, 0)),
        ("1718000000000-3", (1718000000000, 3)),
        ("1718000000000", (1718000000000, 0)),
        ("007-01", (7, 1)),  # leading zeros: the same id
        (f"{MAX_PART}-{MAX_PART - 1}", (MAX_PART, MAX_PART - 1)),
        (f"{MAX_PART}", (MAX_PART, 0)),
    ],
)
def test_entry_ids_redis_accepts_are_parsed(text: str, expected: tuple[int, int]) -> None:
    assert parse_entry_id(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "-",
        "1-",
        "-1",
        "1-2-3",
        "+1-0",
        "-1-0",
        " 1-0",
        "1-0 ",
        "1-0\n",
        "1_000-0",
        "0x10-0",
        "1.5-0",
        "1e3-0",
        "99999999999999999999-0",  # 20 digits, above 2**64
        "18446744073709551616-0",  # 2**64
        "0-18446744073709551616",
        "18446744073709551615-18446744073709551615",  # the largest id: nothing follows it
        "123456789012345678901-0",  # 21 digits
        "\uff11\uff12\uff13-\uff10",  # full-width digits
        "\u0661\u0662\u0663-\u0660",  # Arabic-Indic digits
        "\U0001d7cf\U0001d7d0\U0001d7d1-0",  # mathematical bold digits
        "\u00b2-0",  # a superscript: isdigit() says yes
        "$",
        "+",
        "yesterday",
    ],
)
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(BadCursor):
        parse_entry_id(text)


def _is_redis_id(text: str) -> bool:
    """What Redis takes as an entry id to read after: ms[-seq], each part below 2**64."""
    parts = text.split("-")
    if not 1 <= len(parts) <= 2 or not all(p.isascii() and p.isdigit() for p in parts):
        return False
    values = [int(p) for p in parts] + [0]
    return all(v <= MAX_PART for v in values[:2]) and values[:2] != [MAX_PART, MAX_PART]


@given(st.text(alphabet=st.sampled_from("0123456789-+ _x\uff11\u0663\n"), max_size=45))
def test_the_parser_accepts_exactly_what_redis_would(text: str) -> None:
    accepted = True
    try:
        parse_entry_id(text)
    except BadCursor:
        accepted = False
    if accepted != _is_redis_id(text):  # digits counted: a 21-digit 0-padded part is refused
        assert not accepted and max(len(p) for p in text.split("-")) > 20


@given(st.integers(0, MAX_PART), st.integers(0, MAX_PART - 1))
def test_the_canonical_form_round_trips(ms: int, seq: int) -> None:
    canonical = resume_after(f"{ms}-{seq}")
    assert canonical == f"{ms}-{seq}" and REDIS_ID.fullmatch(canonical)
    assert parse_entry_id(canonical) == (ms, seq)


@given(st.text(max_size=30))
def test_arbitrary_text_is_parsed_or_refused_never_crashes(text: str) -> None:
    try:
        ms, seq = parse_entry_id(text)
    except BadCursor as exc:
        assert str(exc)
    else:
        assert 0 <= ms <= MAX_PART and 0 <= seq <= MAX_PART
