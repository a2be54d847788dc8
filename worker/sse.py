"""Incremental Server-Sent Events decoder: bytes in, events out (pure, no I/O).

Implements the WHATWG "event stream interpretation" exactly:
https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

Design
------
* Line ends are normalised first. A read that holds a CR (rare: providers send LF) is
  rewritten with CRLF and lone CR turned into LF; a read that ends in CR therefore ends
  its line at once, and a LF that opens the next read is swallowed (``_skip_lf``) so a
  CRLF split across reads is still one line end. One BOM at the start of the stream is
  removed, even when it arrives split across reads. After this the text is LF-only.
* Blocks, not lines. In LF-only text a blank line is ``"\\n\\n"``, so each read is cut
  at its *last* ``"\\n\\n"``: everything before is complete events, everything after is
  the start of the next event and waits in ``_rest``. A read without a boundary is only
  appended to a list of pieces (``_parts``), so a huge event arriving in small reads
  costs linear time: nothing is re-scanned and the pieces are joined once, when the
  event ends.
* Decode late, once. Line ends are ASCII, so the complete part never cuts a UTF-8
  character; it is decoded in one call with ``errors="replace"`` (invalid UTF-8 becomes
  U+FFFD exactly as if each line were decoded alone). A character split across reads
  just waits in ``_rest``.
* Hot path. Most events are one ``data: <json>`` line. ``feed()`` splits the complete
  text on ``"\n\ndata: "``; a piece without ``"\n"`` is such an event, and its frozen
  event object is built through the slot descriptors (about twice as fast as the
  generated frozen ``__init__``). ``feed_data()``, what the worker uses, builds no
  objects and decodes nothing: it drops comment-only blocks (keep-alives) from the
  complete bytes and splits them on ``b"\n\ndata: "``; when every LF of the block is in
  a separator, the pieces are the events' data. Anything else (other fields, several
  data lines, extra blank lines) goes through ``_interpret``, the line-by-line reading of
  the spec.
* Size limit. An event's size is the size of its lines after line-end normalisation,
  one byte per line end, without its closing blank line (so ``data: x`` is 7 bytes).
  An event, or the unfinished tail of one, larger than ``max_event_bytes`` raises
  ``EventTooLargeError``: memory stays bounded even for a stream that never sends a blank
  line. The check does not depend on how the bytes were split into reads.
* ``id`` sets the last event id, which persists across events; ``retry`` is the stream's
  reconnection time (stream state too): each event carries the latest valid value seen.
* ``flush()`` ends the stream: it interprets the lines of the unfinished event, the last
  one even without its line end (an ``id:`` there still counts), then discards that event,
  since the spec never dispatches an event without its closing blank line: it returns
  ``[]``. The decoder can then read a new stream (a reconnection); the last event id and
  the reconnection time are kept.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from worker.errors import EventTooLargeError

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SSEDecoder", "ServerSentEvent"]

DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"
_LF = 10
_CR = 13
# A block that is one comment line (a keep-alive), after a blank line: it does nothing.
_COMMENT_BLOCK = re.compile(rb"\n\n:[^\n]*(?=\n\n|\Z)")


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One dispatched event. ``id`` is the last event id, which persists across events."""

    data: str
    event: str = "message"
    id: str = ""
    retry: int | None = None


# Fast construction of the frozen event (see the module docstring): write the slots directly.
_new_event = object.__new__
_slot = vars(ServerSentEvent)
_set_data: Callable[[ServerSentEvent, str], None] = _slot["data"].__set__
_set_event: Callable[[ServerSentEvent, str], None] = _slot["event"].__set__
_set_id: Callable[[ServerSentEvent, str], None] = _slot["id"].__set__
_set_retry: Callable[[ServerSentEvent, int | None], None] = _slot["retry"].__set__


class SSEDecoder:
    """Feed raw response bytes with ``feed()``; call ``flush()`` at the end of the stream."""

    __slots__ = (
        "_at_start",
        "_head",
        "_last_id",
        "_max",
        "_parts",
        "_parts_size",
        "_rest",
        "_retry",
        "_skip_lf",
        "_special",
    )

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be at least 1")
        self._max = max_event_bytes
        self._last_id = ""
        self._retry: int | None = None
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._at_start = True  # a BOM may still come
        self._head = b""  # the first bytes of the stream while the BOM is undecided
        self._skip_lf = False  # the previous read ended with CR
        self._special = True  # _at_start or _skip_lf: feed() must call _normalize()
        # The unfinished event (never starts with LF, never holds a blank line): ``_rest``,
        # or, once reads without a boundary were added to it, the pieces in ``_parts``.
        self._rest = b""
        self._parts: list[bytes] = []
        self._parts_size = 0

    @property
    def last_event_id(self) -> str:
        return self._last_id

    @property
    def retry(self) -> int | None:
        """The reconnection time (milliseconds) from the latest valid ``retry`` field."""
        return self._retry

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Decode one read; return the events it completed (often none or one)."""
        complete = self._complete(data)
        if not complete:
            return []
        text = complete.decode("utf-8", "replace")
        if text[:6] != "data: " or "\n" in text:
            return self._events(text)
        event = _new_event(ServerSentEvent)  # the hot path: one `data: ` line, inlined
        _set_data(event, text[6:])
        _set_event(event, "message")
        _set_id(event, self._last_id)
        _set_retry(event, self._retry)
        return [event]

    def feed_data(self, data: bytes) -> list[bytes]:
        """Like :meth:`feed`, but only the ``data`` of each completed event, whatever its
        type (``id`` and ``retry`` fields still update the stream state), as UTF-8 bytes
        that are not validated: ``.decode("utf-8", "replace")`` gives the event's data.
        Builds no event objects and decodes nothing: a read of plain ``data:`` events and
        comment blocks is split in bulk."""
        complete = self._complete(data)
        if complete[:6] == b"data: " and _LF not in complete:  # one plain event
            return [complete[6:]]
        if not complete:
            return []
        if complete[:1] == b":" or b"\n\n:" in complete:  # drop comment-only blocks
            complete = _COMMENT_BLOCK.sub(b"", b"\n\n" + complete).lstrip(b"\n")
        if complete[:6] == b"data: ":
            fields = complete[6:].split(b"\n\ndata: ")
            if complete.count(_LF) == 2 * len(fields) - 2:  # every LF is in a separator
                return fields
        if not complete:
            return []
        events = self._events(complete.decode("utf-8", "replace"))
        return [event.data.encode() for event in events]

    def _complete(self, data: bytes) -> bytes:
        """Add one read; return the complete events it ends, without their closing blank
        line (b"" when it ends none)."""
        if self._special or _CR in data:
            data = self._normalize(data)
        cut = data.rfind(b"\n\n")
        if cut < 0 and not (data[:1] == b"\n" and self._rest_ends_with_lf()):
            self._keep(data)
            return b""
        rest = self._join_parts() if self._parts else self._rest
        if rest:  # cut == -1 when the blank line is the LF that opens this read
            cut += len(rest)
            data = rest + data
        self._rest = tail = data[cut + 2 :]
        if len(tail) > self._max:
            self._check_rest()
        if cut <= 0:
            return b""
        if cut > self._max:
            self._check_events(data[:cut])
        return data[:cut]

    def flush(self) -> list[ServerSentEvent]:
        """End of stream: interpret the unfinished event's lines, then drop the event."""
        try:
            self._rest = self._head + (self._join_parts() if self._parts else self._rest)
            self._check_rest()
            lines = self._rest.decode("utf-8", "replace").split("\n")
            self._interpret(lines, [])  # only for the fields: the events are discarded
        finally:
            self._reset_stream()
        return []

    def _normalize(self, data: bytes) -> bytes:
        """Swallow the LF of a split CRLF, strip the BOM, turn CRLF and CR into LF."""
        if self._skip_lf and data:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
        if self._at_start:
            data = self._strip_bom(data)
        if _CR in data:
            self._skip_lf = data[-1] == _CR
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        self._special = self._at_start or self._skip_lf
        return data

    def _strip_bom(self, data: bytes) -> bytes:
        data = self._head + data
        if len(data) < len(_BOM) and _BOM.startswith(data):
            self._head = data  # too short to tell yet
            return b""
        self._head = b""
        self._at_start = False
        return data[len(_BOM) :] if data.startswith(_BOM) else data

    def _keep(self, data: bytes) -> None:
        """Add a read without any event boundary to the unfinished event (linear time)."""
        parts = self._parts
        if not parts:
            if not self._rest:
                data = data.lstrip(b"\n")  # blank lines before an event do nothing
            if not data:
                return
            parts.append(self._rest)
            self._parts_size = len(self._rest)
        elif not data:
            return
        parts.append(data)
        self._parts_size += len(data)
        if self._parts_size > self._max:
            self._check_rest()

    def _join_parts(self) -> bytes:
        self._rest = b"".join(self._parts)
        self._parts = []
        return self._rest

    def _rest_ends_with_lf(self) -> bool:
        return (self._parts[-1] if self._parts else self._rest)[-1:] == b"\n"

    def _events(self, text: str) -> list[ServerSentEvent]:
        """Dispatch the complete events in ``text`` (LF-only, no closing blank line)."""
        events: list[ServerSentEvent] = []
        items = text.split("\n\ndata: ")
        first = items[0]
        if first[:6] == "data: " and "\n" not in first:
            items[0] = first[6:]
        else:  # a comment, another field or blank lines come first
            self._interpret(first.split("\n"), events)
            del items[0]
        last_id = self._last_id
        retry = self._retry
        append = events.append
        for item in items:
            if "\n" in item:  # more lines follow the first data line
                self._interpret(("data: " + item).split("\n"), events)
                last_id = self._last_id
                retry = self._retry
                continue
            event = _new_event(ServerSentEvent)
            _set_data(event, item)
            _set_event(event, "message")
            _set_id(event, last_id)
            _set_retry(event, retry)
            append(event)
        return events

    def _interpret(self, lines: list[str], events: list[ServerSentEvent]) -> None:
        """The spec's line-by-line reading; ``lines`` start at an event boundary."""
        data: list[str] = []
        event_type = ""
        for line in lines:
            if not line:
                if data:
                    events.append(self._dispatch(data, event_type))
                    data = []
                event_type = ""
            elif line[0] != ":":  # a ":" line is a comment
                name, _, value = line.partition(":")
                if value[:1] == " ":
                    value = value[1:]
                if name == "data":
                    data.append(value)
                else:
                    event_type = self._field(name, value, event_type)
        if data:
            events.append(self._dispatch(data, event_type))

    def _field(self, name: str, value: str, event_type: str) -> str:
        """Apply a field other than ``data``; return the (possibly new) event type."""
        if name == "event":
            return value
        if name == "id":
            if "\0" not in value:
                self._last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        return event_type

    def _dispatch(self, data: list[str], event_type: str) -> ServerSentEvent:
        return ServerSentEvent("\n".join(data), event_type or "message", self._last_id, self._retry)

    def _check_rest(self) -> None:
        """Raise if the unfinished event is over the limit (a final LF does not count)."""
        if self._parts:
            size, last = self._parts_size, self._parts[-1]
        else:
            size, last = len(self._rest), self._rest
        if size > self._max and last[-1:] == b"\n":
            size -= 1
        if size > self._max:
            self._too_large(size)

    def _check_events(self, complete: bytes) -> None:
        for block in complete.split(b"\n\n"):
            size = len(block.strip(b"\n"))
            if size > self._max:
                self._too_large(size)

    def _too_large(self, size: int) -> None:
        self._reset_stream()
        raise EventTooLargeError(
            f"SSE event of {size} bytes or more exceeds the limit of "
            f"max_event_bytes={self._max} bytes",
            detail={"limit": self._max, "size": size},
        )
