"""SSE decoder vectors (bytes -> events' data), every split of every vector, properties.

Every vector is decoded in one read, one byte at a time, and split at every point into
two and into three reads. Hypothesis checks that any split of any stream gives what a
single read gives, and that both equal ``reference``: a literal, line-by-line reading of
the WHATWG event-stream interpretation, kept deliberately naive. The decoder returns only
each event's data (what the worker reads); the reference reads every field, and the
vectors keep them, to show that no other field changes any data.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import EventTooLargeError, ProtocolError
from worker.protocol.sse import DEFAULT_MAX_EVENT_BYTES, SSEDecoder

BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class ServerSentEvent:
    """An event as the spec dispatches it (the reference's output)."""

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


E = ServerSentEvent


def feed_all(decoder: SSEDecoder, pieces: Iterable[bytes]) -> list[str]:
    """Feed every piece; the data of all events in order, decoded."""
    fields = [field for piece in pieces for field in decoder.feed_data(piece)]
    return [field.decode("utf-8", "replace") for field in fields]


def datas(events: list[ServerSentEvent]) -> list[str]:
    return [event.data for event in events]


def splits(data: bytes) -> Iterator[list[bytes]]:
    """One read, one byte per read, and every split into two and into three reads."""
    yield [data]
    yield [data[i : i + 1] for i in range(len(data))]
    for i in range(len(data) + 1):
        yield [data[:i], data[i:]]
        for j in range(i, len(data) + 1):
            yield [data[:i], data[i:j], data[j:]]


def cut(data: bytes, points: Iterable[int]) -> list[bytes]:
    bounds = [0, *sorted(points), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def reference(stream: bytes) -> tuple[list[ServerSentEvent], str, int | None]:
    """The spec, line by line: events, last event id and reconnection time at the end."""
    if stream.startswith(BOM):
        stream = stream[len(BOM) :]
    *lines, final = re.split(rb"\r\n|\r|\n", stream)
    events: list[ServerSentEvent] = []
    data: list[str] = []
    event_type, last_id, retry = "", "", None
    for raw in [*lines, final] if final else lines:
        line = raw.decode("utf-8", "replace")
        if not line:
            if data:
                events.append(E("\n".join(data), event_type or "message", last_id, retry))
            data, event_type = [], ""
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if not name:
            continue  # a comment
        if name == "data":
            data.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and re.fullmatch("[0-9]+", value):
            retry = int(value)
    return events, last_id, retry


# --- vectors: (input bytes, expected events) ------------------------------------------

CHUNK = '{"id":"gen-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{}}]}'

VECTORS: dict[str, tuple[bytes, list[ServerSentEvent]]] = {
    # line ends
    "lf": (b"data: a\n\n", [E("a")]),
    "crlf": (b"data: a\r\n\r\n", [E("a")]),
    "cr": (b"data: a\r\r", [E("a")]),
    "mixed line ends": (b"data: a\rdata: b\ndata: c\r\n\n", [E("a\nb\nc")]),
    "lf then cr is two line ends": (b"data: a\n\rdata: b\n\n", [E("a"), E("b")]),
    "cr cr lf": (b"data: a\r\r\ndata: b\r\n\r\n", [E("a"), E("b")]),
    "other control chars are no line ends": (
        b"data: a\x0bb\x0cc\x1cd\x1de\x1ef\xc2\x85g\xe2\x80\xa8h\n\n",
        [E("a\x0bb\x0cc\x1cd\x1de\x1ef\x85g\u2028h")],
    ),
    # data
    "two data lines joined with lf": (b"data: a\ndata: b\n\n", [E("a\nb")]),
    "no space after colon": (b"data:a\n\n", [E("a")]),
    "only one space removed": (b"data:  a \n\n", [E(" a ")]),
    "tab is kept": (b"data:\ta\n\n", [E("\ta")]),
    "data without colon is empty": (b"data\n\n", [E("")]),
    "data colon alone is empty": (b"data:\n\n", [E("")]),
    "two empty data lines": (b"data\ndata:\n\n", [E("\n")]),
    "empty data then text": (b"data:\ndata: x\n\n", [E("\nx")]),
    "colons in value": (b"data: a: b:c\n\n", [E("a: b:c")]),
    "data in value": (b"data: data: x\n\n", [E("data: x")]),
    "nul in data kept": (b"data: a\x00b\n\n", [E("a\x00b")]),
    "data after other fields": (b"id: 1\nevent: e\ndata: x\n\n", [E("x", "e", "1")]),
    "fields after data": (b"data: x\nevent: e\nid: 2\n\n", [E("x", "e", "2")]),
    "json chunk": (f"data: {CHUNK}\n\n".encode(), [E(CHUNK)]),
    "done": (b"data: [DONE]\n\n", [E("[DONE]")]),
    # dispatch
    "no blank line, no event": (b"data: a\n", []),
    "unterminated line, no event": (b"data: a", []),
    "unterminated blank line": (b"data: a\n\ndata: b\n", [E("a")]),
    "blank lines alone": (b"\n\n\r\n\r\r\n", []),
    "blank lines between events": (b"data: a\n\n\n\n\ndata: b\n\n\n", [E("a"), E("b")]),
    "starts with blank lines": (b"\n\ndata: a\n\n", [E("a")]),
    "many events": (b"data: 1\n\ndata: 2\n\ndata: 3\n\n", [E("1"), E("2"), E("3")]),
    # event type
    "event type": (b"event: add\ndata: x\n\n", [E("x", "add")]),
    "event type resets after dispatch": (
        b"event: add\ndata: x\n\ndata: y\n\n",
        [E("x", "add"), E("y")],
    ),
    "event type resets on a blank line without data": (
        b"event: add\n\ndata: y\n\n",
        [E("y")],
    ),
    "empty event type is message": (b"event\ndata: x\n\nevent:\ndata: y\n\n", [E("x"), E("y")]),
    "last event type wins": (b"event: a\nevent: b\ndata: x\n\n", [E("x", "b")]),
    "event without data is not dispatched": (b"event: e\n\n", []),
    # id
    "id persists": (b"id: 1\ndata: a\n\ndata: b\n\n", [E("a", id="1"), E("b", id="1")]),
    "empty id resets": (b"id: 1\ndata: a\n\nid\ndata: b\n\n", [E("a", id="1"), E("b")]),
    "id with nul ignored": (
        b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n",
        [E("a", id="1"), E("b", id="1")],
    ),
    "id set by an event that is not dispatched": (b"id: 5\n\ndata: x\n\n", [E("x", id="5")]),
    "id unicode": ("id: é€\ndata: x\n\n".encode(), [E("x", id="é€")]),
    # retry
    "retry": (b"retry: 1500\ndata: x\n\n", [E("x", retry=1500)]),
    "retry persists": (b"retry: 10\n\ndata: x\n\n", [E("x", retry=10)]),
    "retry not digits": (b"retry: 15a\ndata: x\n\n", [E("x")]),
    "retry empty": (b"retry\ndata: x\n\nretry:\ndata: y\n\n", [E("x"), E("y")]),
    "retry negative": (b"retry: -1\ndata: x\n\n", [E("x")]),
    "retry two spaces": (b"retry:  15\ndata: x\n\n", [E("x")]),
    "retry non-ascii digits": ("retry: ١٢\ndata: x\n\n".encode(), [E("x")]),
    "invalid retry keeps the old value": (
        b"retry: 7\nretry: x\ndata: a\n\n",
        [E("a", retry=7)],
    ),
    # comments and unknown fields
    "comment": (b": keep-alive\n\ndata: x\n\n", [E("x")]),
    "openrouter comment": (b": OPENROUTER PROCESSING\n\n: OPENROUTER PROCESSING\n\n", []),
    "colon alone is a comment": (b":\n\ndata: x\n\n", [E("x")]),
    "comment between data lines": (b"data: a\n: c\ndata: b\n\n", [E("a\nb")]),
    "comment after data": (b"data: a\n: c\n\n", [E("a")]),
    "comment then data in one event": (b": c\ndata: a\n\n", [E("a")]),
    "keep-alives between events": (
        b": keep-alive\n\ndata: a\n\n: keep-alive\n\n:\n\ndata: b\n\n: x\n\n",
        [E("a"), E("b")],
    ),
    "comment block then blank lines": (b"data: a\n\n: c\n\n\n\ndata: b\n\n", [E("a"), E("b")]),
    "comment then event type": (b": c\n\nevent: e\ndata: a\n\n: c\n\n", [E("a", "e")]),
    "data line that looks like a comment block": (b"data: a\n\ndata: :x\n\n", [E("a"), E(":x")]),
    "unknown field": (b"foo: bar\ndata: x\n\n", [E("x")]),
    "field names are case-sensitive": (b"Data: x\n\nDATA: y\n\nEvent: e\ndata: z\n\n", [E("z")]),
    "space before colon": (b"data : x\n\n", []),
    "leading space in name": (b" data: x\n\n", []),
    # BOM
    "bom removed": (BOM + b"data: x\n\n", [E("x")]),
    "only one bom removed": (BOM + BOM + b"data: x\n\ndata: y\n\n", [E("y")]),
    "bom not at start kept": (b"data: a\n\n" + BOM + b"data: b\n\n", [E("a")]),
    "bom in value kept": (b"data: " + BOM + b"x\n\n", [E("\ufeffx")]),
    "partial bom": (b"\xef\xbbdata: x\n\ndata: y\n\n", [E("y")]),
    "bom then blank line": (BOM + b"\ndata: x\n\n", [E("x")]),
    "bom only": (BOM, []),
    # UTF-8
    "multibyte": ("data: héllo €😀\n\n".encode(), [E("héllo €😀")]),
    "invalid utf-8 replaced": (b"data: a\xff\xfeb\n\n", [E("a\ufffd\ufffdb")]),
    "truncated sequence replaced": (b"data: \xe2\x82\n\n", [E("\ufffd")]),
    "truncated sequence before lf": (
        b"data: \xe2\ndata: \x82\xac\n\n",
        [E("\ufffd\n\ufffd\ufffd")],
    ),
    "invalid field name": (b"d\xffta: x\n\ndata: y\n\n", [E("y")]),
    "event type utf-8": ("event: é\ndata: x\n\n".encode(), [E("x", "é")]),
}


@pytest.mark.parametrize(("stream", "expected"), list(VECTORS.values()), ids=list(VECTORS))
def test_vector_matches_reference(stream: bytes, expected: list[ServerSentEvent]) -> None:
    """The table and the naive reference reading of the spec agree."""
    assert reference(stream)[0] == expected


@pytest.mark.parametrize(("stream", "expected"), list(VECTORS.values()), ids=list(VECTORS))
def test_vector_every_split(stream: bytes, expected: list[ServerSentEvent]) -> None:
    for pieces in splits(stream):
        assert feed_all(SSEDecoder(), pieces) == datas(expected), pieces


def test_feed_data_splits_a_long_read_in_bulk() -> None:
    chunks = [f'{{"n":{i}}}' for i in range(300)]
    body = "".join(
        f"data: {c}\n\n" + (": keep-alive\n\n" if i % 50 == 0 else "") for i, c in enumerate(chunks)
    )
    decoder = SSEDecoder()
    assert decoder.feed_data(body.encode()) == [c.encode() for c in chunks]
    assert decoder.feed_data(b"data: x\n") == []
    assert decoder.feed_data(b"\nid: 7\ndata: y\n\n") == [b"x", b"y"]


def test_an_unfinished_event_is_never_returned() -> None:
    decoder = SSEDecoder()
    assert decoder.feed_data(b"data: a\n\ndata: b\n") == [b"a"]
    assert decoder.feed_data(b"data: c") == []


def test_cr_at_end_of_read_dispatches_at_once() -> None:
    decoder = SSEDecoder()
    assert decoder.feed_data(b"data: a\r") == []
    assert decoder.feed_data(b"\r") == [b"a"]  # no need to wait for a possible LF
    assert decoder.feed_data(b"\ndata: b\r\n") == []  # this LF ends nothing: it closes CRLF
    assert decoder.feed_data(b"\r\n") == [b"b"]


def test_events_are_returned_by_the_read_that_completes_them() -> None:
    decoder = SSEDecoder()
    assert decoder.feed_data(b"data: a") == []
    assert decoder.feed_data(b"\n") == []
    assert decoder.feed_data(b"\n") == [b"a"]
    assert decoder.feed_data(b"data: b\n\ndata: c\n\ndata: d") == [b"b", b"c"]
    assert decoder.feed_data(b"\n\n") == [b"d"]


def test_realistic_stream() -> None:
    chunks = [
        {"id": "gen-1", "object": "chat.completion.chunk", "created": 1751299200,
         "model": "z-ai/glm-5.2",
         "choices": [{"index": 0, "delta": {"content": f"tok{i} ü\n"}, "finish_reason": None}]}
        for i in range(200)
    ]  # fmt: skip
    body = b": OPENROUTER PROCESSING\n\n"
    for i, chunk in enumerate(chunks):
        body += f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        if i % 50 == 0:
            body += b": keep-alive\n\n"
    body += b"data: [DONE]\n\n"
    expected = [E(json.dumps(c, ensure_ascii=False)) for c in chunks] + [E("[DONE]")]
    for size in (1, 7, 300, 4096, 65536):
        pieces = cut(body, range(size, len(body), size))
        assert feed_all(SSEDecoder(), pieces) == datas(expected)
    assert reference(body)[0] == expected


# --- size limit -----------------------------------------------------------------------


def test_default_limit() -> None:
    assert DEFAULT_MAX_EVENT_BYTES == 8 * 1024 * 1024
    with pytest.raises(ValueError, match="max_event_bytes"):
        SSEDecoder(max_event_bytes=0)


@pytest.mark.parametrize(
    "stream",
    [
        b"data: 1234\n\n",  # an event is its lines without the closing blank line: 10 bytes
        b"data: 1234\r\n\r\n",
        b"data\ndata\n\n",
        b"data: 1234\n",
        b"data: 1234",
        b": 34567890\n\n: 34567890\n\ndata: 1234\n\n",
        b"\n\n\n\n\n\n\n\n\n\n\n\ndata: 1234\n\n\n\n\n\n\n\n\n\n\n\n\n",
    ],
)
def test_limit_not_reached(stream: bytes) -> None:
    for pieces in splits(stream):
        feed_all(SSEDecoder(max_event_bytes=10), pieces)


@pytest.mark.parametrize(
    "stream",
    [
        b"data: 12345\n\n",
        b"data: 12345\n",
        b"data: 12345",
        b"data: 1\ndata: 2\n\n",  # the lines of one event add up
        b"data: 1234\n: x\n\n",  # comments count: memory is what the limit protects
        b": comment\n: comment\n",  # a stream that never sends a blank line
        b"data: 1\n\ndata: 1\n\ndata: 12345\n\n",
    ],
)
def test_limit_exceeded(stream: bytes) -> None:
    for pieces in splits(stream):
        decoder = SSEDecoder(max_event_bytes=10)
        with pytest.raises(EventTooLargeError, match=r"max_event_bytes=10 bytes") as info:
            feed_all(decoder, pieces)
        assert isinstance(info.value, ProtocolError)
        assert info.value.code == "event_too_large"
        assert info.value.detail["limit"] == 10
        assert info.value.detail["size"] > 10


def test_limit_raises_before_the_event_ends() -> None:
    """Memory stays bounded: the error comes while the huge event is still arriving."""
    decoder = SSEDecoder(max_event_bytes=1000)
    decoder.feed_data(b"data: ")
    with pytest.raises(EventTooLargeError, match="1000") as info:
        for _ in range(1000):
            decoder.feed_data(b"x" * 100)
    assert info.value.detail["size"] <= 1100
    assert "SSE event" in str(info.value)


def test_limit_for_many_small_lines() -> None:
    decoder = SSEDecoder(max_event_bytes=1000)
    with pytest.raises(EventTooLargeError):
        for _ in range(1000):
            decoder.feed_data(b"data: x\n")


# --- large events in small reads: linear time -----------------------------------------


def test_five_megabyte_line_in_small_reads() -> None:
    payload = b"x" * (5 * 1024 * 1024)
    body = b"data: " + payload + b"\n\n"
    decoder = SSEDecoder()
    pieces = cut(body, range(300, len(body), 300))
    assert feed_all(decoder, pieces) == [payload.decode()]


def test_five_megabyte_event_of_many_lines_in_small_reads() -> None:
    line = b"data: " + b"y" * 94 + b"\n"
    body = line * (5 * 1024 * 1024 // len(line)) + b"\n"
    pieces = cut(body, range(300, len(body), 300))
    assert feed_all(SSEDecoder(), pieces) == [
        "\n".join(["y" * 94] * (5 * 1024 * 1024 // len(line)))
    ]


def test_many_comment_lines_in_small_reads() -> None:
    body = b": keep-alive\n" * 200_000 + b"data: x\n\n"
    pieces = cut(body, range(300, len(body), 300))
    assert feed_all(SSEDecoder(), pieces) == ["x"]


# --- properties -----------------------------------------------------------------------

VALUES = st.text(
    alphabet=st.sampled_from(["a", " ", ":", "é", "€", "😀", "\0", "\ufeff", "1", "\x85"]),
    max_size=6,
)
FIELD_LINES = st.one_of(
    st.builds(lambda v: "data:" + v, VALUES),
    st.builds(lambda v: "data: " + v, VALUES),
    st.just("data"),
    st.builds(lambda v: "event: " + v, VALUES),
    st.builds(lambda v: "id: " + v, VALUES),
    st.builds(lambda v: "retry: " + v, st.sampled_from(["", "0", "15", "1a", "-3", "٣"])),
    st.builds(lambda v: ":" + v, VALUES),
    st.builds(lambda n, v: n + ": " + v, st.sampled_from(["foo", "Data", "dat", ""]), VALUES),
    st.just(""),
)


@st.composite
def valid_streams(draw: st.DrawFn) -> bytes:
    """Lines from the field vocabulary, any line ends, an optional BOM and cut-off end."""
    lines = draw(st.lists(FIELD_LINES, max_size=25))
    ends = draw(st.lists(st.sampled_from(["\n", "\r", "\r\n"]), min_size=len(lines)))
    text = "".join(line + end for line, end in zip(lines, ends, strict=False))
    stream = text.encode()
    if draw(st.booleans()):
        stream = BOM + stream
    if draw(st.booleans()):
        stream = stream[: draw(st.integers(0, len(stream)))]
    return stream


ARBITRARY = st.one_of(
    st.binary(max_size=200),
    st.lists(
        st.sampled_from([b"data", b":", b" ", b"\r", b"\n", b"\xef", b"\xbb", b"\xbf",
                         b"\xe2\x82\xac", b"\xff", b"id", b"retry", b"event", b"7", b"\0",
                         b"\n\n", b"data: x\n\n", b"\r\n"]),
        max_size=60,
    ).map(b"".join),
)  # fmt: skip


def _run(limit: int, pieces: list[bytes]) -> tuple[list[str], bool]:
    """The data the decoder returned before an error (if any), decoded, and whether the
    limit was hit."""
    decoder = SSEDecoder(max_event_bytes=limit)
    out: list[bytes] = []
    raised = False
    try:
        for piece in pieces:
            out.extend(decoder.feed_data(piece))
    except EventTooLargeError:
        raised = True
    return [field.decode("utf-8", "replace") for field in out], raised


@settings(max_examples=300)
@given(valid_streams(), st.data())
def test_any_split_of_a_valid_stream(stream: bytes, data: st.DataObject) -> None:
    points = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    expected = datas(reference(stream)[0])
    assert feed_all(SSEDecoder(), [stream]) == expected
    assert feed_all(SSEDecoder(), cut(stream, points)) == expected


@settings(max_examples=300)
@given(ARBITRARY, st.data(), st.sampled_from([1, 2, 3, 5, 8, 16, 64, 10_000]))
def test_arbitrary_bytes_in_arbitrary_splits(
    stream: bytes, data: st.DataObject, limit: int
) -> None:
    points = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    whole, whole_raised = _run(limit, [stream])
    split, split_raised = _run(limit, cut(stream, points))
    assert split_raised == whole_raised
    expected = datas(reference(stream)[0])
    if whole_raised:
        assert whole == []  # the single read raised before returning anything
        assert split == expected[: len(split)]
    else:
        assert whole == split == expected


# --- progress: what the idle timeout counts ------------------------------------------


def complete_blocks(stream: bytes) -> int:
    """Blocks (events or comments) ended by a blank line in ``stream``, by the reference's
    reading of lines: blank lines alone are no block."""
    if stream.startswith(BOM):
        stream = stream[len(BOM) :]
    *lines, _unterminated = re.split(rb"\r\n|\r|\n", stream)
    blocks, open_block = 0, False
    for line in lines:
        if line:
            open_block = True
        elif open_block:
            blocks, open_block = blocks + 1, False
    return blocks


PROGRESS_VECTORS = {
    **{name: stream for name, (stream, _) in VECTORS.items()},
    "keep-alive comments": b": keep-alive\n\n: ping\n\ndata: a\n\n",
    "blank lines only": b"\n\n\n\n\r\n\r\n",
    "an event of other fields": b"event: ping\nid: 3\n\n",
}


@pytest.mark.parametrize("stream", list(PROGRESS_VECTORS.values()), ids=list(PROGRESS_VECTORS))
def test_progress_grows_with_exactly_the_reads_that_complete_a_block(stream: bytes) -> None:
    for pieces in splits(stream):
        decoder, seen = SSEDecoder(), b""
        for piece in pieces:
            before = decoder.progress
            decoder.feed_data(piece)
            completed = complete_blocks(seen + piece) > complete_blocks(seen)
            seen += piece
            assert (decoder.progress > before) == completed, (pieces, piece)


def test_a_dripped_event_makes_no_progress_and_counts_its_bytes() -> None:
    decoder = SSEDecoder()
    decoder.feed_data(b"data: a\n\n")
    assert (decoder.progress, decoder.unfinished) == (1, 0)
    dripped = b'data: {"choices":[{"delta":{"content":"xxxxxxxxxxxx'
    for i in range(len(dripped)):
        assert decoder.feed_data(dripped[i : i + 1]) == []
    assert (decoder.progress, decoder.unfinished) == (1, len(dripped))
    assert decoder.feed_data(b"\n\n") == [dripped[6:]]
    assert (decoder.progress, decoder.unfinished) == (2, 0)


def test_blank_lines_between_events_are_no_progress() -> None:
    decoder = SSEDecoder()
    decoder.feed_data(b"data: a\n\n")
    for _ in range(5):
        decoder.feed_data(b"\n")
    assert decoder.progress == 1
