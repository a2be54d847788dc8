"""The one parser of the stream entry ids clients send the gateway (pure).

``Last-Event-ID`` and ``?after=`` name the entry a client resumes after. Redis accepts an
entry id ``<ms>-<seq>`` (or ``<ms>``: sequence 0) whose parts are decimal integers below
2**64; anything else makes its ``XRANGE`` fail, and it would fail only once the response
has started: a cut-off body. So every id is parsed here, strictly, before the response
starts, and a bad one is answered 400 ``invalid_cursor`` (docs/gateway.md).

Strictly means: ASCII digits only (Python's ``int()`` and regex ``\\d`` also take Unicode
and full-width digits), no sign, no space, no ``_``, at most 20 digits a part, each part
below 2**64; and not the largest id of all, after which nothing can ever come (Redis
refuses an exclusive range that starts there).
"""

from __future__ import annotations

import re

MAX_PART = 2**64 - 1
_ENTRY_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?", re.ASCII)
EXPECTED = "an entry id such as 1718000000000-0 (two decimal integers below 2**64)"


class BadCursor(ValueError):
    """The text is not an entry id a client may resume after; ``str()`` says why."""


def parse_entry_id(text: str) -> tuple[int, int]:
    """``(ms, seq)`` of ``"<ms>-<seq>"`` or ``"<ms>"``; BadCursor for anything else."""
    match = _ENTRY_ID.fullmatch(text)
    if match is None:
        raise BadCursor(f"expected {EXPECTED}")
    ms, seq = int(match[1]), int(match[2] or 0)
    if ms > MAX_PART or seq > MAX_PART:
        raise BadCursor(f"expected {EXPECTED}; a part is 2**64 or larger")
    if ms == seq == MAX_PART:
        raise BadCursor("no entry can follow the largest entry id")
    return ms, seq


def resume_after(text: str) -> str:
    """The canonical ``ms-seq`` form of a client's cursor (BadCursor when it is none)."""
    ms, seq = parse_entry_id(text)
    return f"{ms}-{seq}"
