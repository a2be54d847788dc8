"""Chunk templates: read a stream's repetitive chunks without parsing their JSON.

A provider sends thousands of chunks that differ only in one short string: the text
token, a tool call's argument fragment or a reasoning fragment. The rest (id, model,
created, the choice's envelope) repeats byte for byte. A :class:`ChunkTemplate` is that
repeated text with holes where the strings go; matching a data field against it is a few
string comparisons instead of a JSON parse.

Why a match is exact
--------------------
In JSON, a string whose characters are all "clean" (no ``"``, no ``\\``, no control
character below U+0020) is one string token whatever those characters are. So if the
template's literal parts hold the same bytes as a chunk that was parsed, and every hole
holds one string token, the matched data parses to that chunk with the hole values in
place. :func:`learn` proves the first part when it builds a template: it parses the data
again with a distinct sentinel in each hole and checks that exactly the expected fields
changed (so a value that also appears elsewhere, a duplicate key or an escaped quote
can only make learning fail, never make a match wrong). :meth:`ChunkTemplate.match`
checks the second.

When every hole held the same value at learning time (one hole, or OpenRouter's token in
both ``delta.reasoning`` and ``reasoning_details[0].text``), the template is *linked*: a
hole's size follows from the data's length, and the data must equal the literals joined
by that one hole, a single comparison. OpenAI adds a random ``obfuscation`` string as the
chunk's last key: when the last hole is such a random one and the others are linked, it
opens at the last quote before the final literal (so it holds no quote), and the data
before it must start with the other literals joined by one value. Otherwise each hole but
the last ends at the first quote after its start that no backslash escapes, the literal
that follows must be there, and the last hole ends where the last literal starts.

Every hole is then checked to be one valid JSON string: if it holds a quote, a backslash
or a non-printable character, ``from_json(b'"' + hole + b'"')`` decides, which succeeds
exactly when it is one valid JSON string and then gives its value (an ignored hole of
letters and digits needs no check). Invalid UTF-8 in the folded hole never matches: the
parser's U+FFFD path decides (in an ignored hole it changes nothing the accumulator
reads).

Holes
-----
``want`` is the value the accumulator folds; ``ignore`` paths are string fields it never
reads and that may change from chunk to chunk: OpenRouter's ``delta.reasoning`` next to
``reasoning_details`` (usually the same value: such holes may be linked) and the
``random`` ones, never linked (OpenAI's random ``obfuscation`` padding). Any other change,
a number included (a tool call's ``index``), is a different template.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, TypeVar

from pydantic_core import from_json

__all__ = ["ChunkTemplate", "Path", "is_clean", "learn", "parse_json"]

Path = tuple[str | int, ...]
K = TypeVar("K")


def parse_json(data: bytes) -> Any:
    """``from_json`` without its string cache: jiter keeps up to 16,384 strings (keys and
    values) in a process-wide cache, and an upstream's values are mostly new (completion ids,
    tokens), so the cache filled with one job's strings after another through a worker's
    first thousands of jobs (about 1 MB; docs/decisions.md, 75) for no measured gain."""
    return from_json(data, cache_strings=False)


def is_clean(value: str) -> bool:
    """A string whose JSON form is itself between quotes (see the module docstring)."""
    return '"' not in value and "\\" not in value and value.isprintable()


class ChunkTemplate(Generic[K]):
    """Literal parts of a data field (UTF-8 bytes) with string holes between them; ``key``
    is what the accumulator needs to fold the value (what it appends to)."""

    __slots__ = ("_count", "_fixed", "_head", "_linked", "_literals", "_middles",
                 "_random_last", "_start", "_tail", "_tail_size", "_want", "key")  # fmt: skip

    def __init__(
        self, literals: list[bytes], want: int, key: K, *, linked: bool, random_last: bool
    ) -> None:
        """``linked``: every hole held the same value; ``random_last``: all but the last
        did, and the last is a random string (see the module docstring)."""
        self._head, *self._middles, self._tail = literals  # the tail is never b""
        self._tail_size = len(self._tail)
        self._random_last = random_last
        self._literals = tuple(literals[:-1] if random_last else literals)
        self._count = len(self._literals) - 1  # the holes holding the one value
        self._linked = linked or self._count == 1
        self._start = len(self._head)
        self._fixed = sum(map(len, self._literals))
        self._want = want  # which hole holds the folded value
        self.key = key

    def match(self, data: bytes) -> str | None:
        """The folded value of ``data`` if it fits the template (non-empty), else None."""
        end, start = len(data), self._start
        if self._random_last:  # the random hole opens at the last quote before the tail
            end -= self._tail_size
            opens = data.rfind(_QUOTE, start, end)
            random = data[opens + 1 : end]
            valid = random.isalnum() or _is_string(random)  # (OpenAI's: letters and digits)
            if opens < 0 or not valid or not data.endswith(self._tail):
                return None
            end = opens + 1
        elif not self._linked:
            return self._match_holes(data)
        # One value in every hole up to ``end``: its size follows from the length, and the
        # data must start with the literals joined by it.
        size = end - self._fixed
        if self._count > 1:
            size, rest = divmod(size, self._count)
            size = -1 if rest else size
        raw = data[start : start + size]
        if size <= 0 or not data.startswith(raw.join(self._literals)):
            return None
        if _QUOTE not in raw and _BACKSLASH not in raw:  # (_value's common case, inline)
            try:
                value = raw.decode()
            except UnicodeDecodeError:
                return None
            if value.isprintable():
                return value
        return _value(raw)

    def _match_holes(self, data: bytes) -> str | None:
        """Holes of different values (see the module docstring)."""
        if (
            len(data) <= self._fixed
            or not data.startswith(self._head)
            or not data.endswith(self._tail)
        ):
            return None
        stop = len(data) - len(self._tail)
        start, holes = self._start, []
        for literal in self._middles:
            end = data.find(_QUOTE, start, stop)
            if data[end - 1] == _BACKSLASH:  # (-1: data[-2] is the tail's quote, no backslash)
                end = _closing_quote(data, start, stop)
            if end < 0 or not data.startswith(literal, end):
                return None
            holes.append(data[start:end])
            start = end + len(literal)
        if start > stop:
            return None
        holes.append(data[start:stop])
        want = holes.pop(self._want)
        return _value(want) if all(map(_is_string, holes)) else None


_QUOTE, _BACKSLASH = ord('"'), ord("\\")  # ints: `in` and find() skip the buffer protocol


def _closing_quote(data: bytes, start: int, stop: int) -> int:
    """The first quote in ``data[start:stop]`` that no backslash escapes, or -1."""
    end = data.find(_QUOTE, start, stop)
    while end > start and data[end - 1] == _BACKSLASH:
        escapes = end - 1
        while escapes > start and data[escapes - 1] == _BACKSLASH:
            escapes -= 1
        if (end - escapes) % 2 == 0:
            break
        end = data.find(_QUOTE, end + 1, stop)
    return end


def _is_string(raw: bytes) -> bool:
    """Whether an ignored hole is one valid JSON string (OpenAI's obfuscation: letters and
    digits)."""
    return raw.isalnum() or not raw or _json_string(raw) is not None


def _value(raw: bytes) -> str | None:
    """A hole's value if it is one valid, non-empty JSON string (invalid UTF-8 is left to
    the parser's U+FFFD path)."""
    if _QUOTE in raw or _BACKSLASH in raw:
        return _json_string(raw)
    try:
        value = raw.decode()
    except UnicodeDecodeError:
        return None
    return value if value.isprintable() else _json_string(raw)


def _json_string(raw: bytes) -> str | None:
    """A hole with escapes (or other characters to check): it holds one valid JSON string
    exactly when ``"raw"`` parses, and then that parse is its value (None when empty)."""
    try:
        value = parse_json(b'"' + raw + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def learn(
    data: bytes,
    chunk: Any,
    want: Path,
    ignore: tuple[Path, ...],
    random: tuple[Path, ...],
    key: K,
) -> ChunkTemplate[K] | None:
    """The template of ``data`` (which parsed to ``chunk``) with holes at ``want`` and at
    the ``ignore`` and ``random`` paths that hold strings; None when it cannot be proven
    exact."""
    holes, values = [], []
    for path in (want, *ignore, *random):
        value = _get(chunk, path)
        if isinstance(value, str) and value:
            if not is_clean(value):
                return None
            holes.append(path)
            values.append(value)
    if not holes or holes[0] is not want:
        return None
    spans = _spans(data, [value.encode() for value in values])
    if spans is None:
        return None
    order = _prove(data, chunk, holes, values, spans)
    if order is None:
        return None
    bounds = [0, *(at for span in spans for at in span), len(data)]
    literals = [data[bounds[i] : bounds[i + 1]] for i in range(0, len(bounds), 2)]
    if any(_BACKSLASH in literal for literal in literals):
        return None
    linked = len(set(values)) == 1 and not any(path in random for path in holes)
    last = order[-1]  # the hole in the last position
    others = {value for hole, value in enumerate(values) if hole != last}
    random_last = holes[last] in random and len(others) == 1
    return ChunkTemplate(literals, order.index(0), key, linked=linked, random_last=random_last)


def _spans(data: bytes, values: list[bytes]) -> list[tuple[int, int]] | None:
    """Where the values sit in ``data`` (each as a whole JSON string), in order; None
    unless every quoted occurrence of every value is accounted for, once."""
    spans: set[tuple[int, int]] = set()
    for value in set(values):
        quoted = b'"' + value + b'"'
        found = []
        at = data.find(quoted)
        while at >= 0:
            found.append((at + 1, at + 1 + len(value)))
            at = data.find(quoted, at + 1)
        if len(found) != values.count(value):
            return None
        spans.update(found)
    ordered = sorted(spans)
    if any(a[1] >= b[0] for a, b in itertools.pairwise(ordered)):
        return None
    return ordered


def _prove(
    data: bytes, chunk: Any, holes: list[Path], values: list[str], spans: list[tuple[int, int]]
) -> list[int] | None:
    """Parse ``data`` with a sentinel in each span; return, per span, the index of the
    hole it fills, if the sentinels land in exactly the holes and nothing else changed."""
    mark = b"~"
    while mark in data:
        mark += b"~"
    sentinels = [f"{mark.decode()}{i}{mark.decode()}" for i in range(len(spans))]
    parts, last = [], 0
    for (start, end), sentinel in zip(spans, sentinels, strict=True):
        parts += [data[last:start], sentinel.encode()]
        last = end
    try:
        probe = parse_json(b"".join([*parts, data[last:]]))
    except ValueError:
        return None
    order = [-1] * len(spans)
    for hole, path in enumerate(holes):
        found = _get(probe, path)
        if found not in sentinels or order[sentinels.index(found)] != -1:
            return None
        order[sentinels.index(found)] = hole
        _set(probe, path, values[hole])
    return order if probe == chunk else None


def _get(node: Any, path: Path) -> Any:
    """The value at ``path``, or None. (A string indexed by a position gives a character,
    but every path here continues with a key after a position, or ends in a key.)"""
    try:
        for step in path:
            node = node[step]
    except (LookupError, TypeError):
        return None
    return node


def _set(node: Any, path: Path, value: Any) -> None:
    _get(node, path[:-1])[path[-1]] = value
