"""Incremental Server-Sent Events decoder: bytes in, each event's data out (pure, no I/O).

Implements the WHATWG "event stream interpretation" for what the worker reads, the data
of each dispatched event:
https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
Other fields (``event``, ``id``, ``retry``) and comments change no event's data; they are
read and ignored.

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
* Bulk, as bytes. Most events are one ``data: <json>`` line. :meth:`SSEDecoder.feed_data`
  drops comment-only blocks (keep-alives) from the complete bytes and splits them on
  ``b"\\n\\ndata: "``; when every LF of the block is in a separator, the pieces are the
  events' data, undecoded. Anything else (other fields, several data lines, extra blank
  lines) goes through ``_interpret``, the line-by-line reading of the spec, decoded once
  with ``errors="replace"`` (invalid UTF-8 becomes U+FFFD exactly as if each line were
  decoded alone; line ends are ASCII, so a cut never splits a character).
* Size limit. An event's size is the size of its lines after line-end normalisation,
  one byte per line end, without its closing blank line (so ``data: x`` is 7 bytes).
  An event, or the unfinished tail of one, larger than ``max_event_bytes`` raises
  ``EventTooLargeError``: memory stays bounded even for a stream that never sends a blank
  line. The check does not depend on how the bytes were split into reads.
* The end of the stream needs no call: the spec never dispatches an event without its
  closing blank line, so an unfinished event is simply dropped with the decoder.
* Progress. ``progress`` grows with every read that completes at least one block, an
  event or a comment (a keep-alive); blank lines alone complete nothing. ``unfinished``
  is the size of the event begun and not ended yet. The worker's idle timeout counts
  progress, not bytes: an upstream that drips an event byte by byte does not keep it
  alive (docs/decisions.md, 49).
"""

from __future__ import annotations

import re

from worker.errors import EventTooLargeError

__all__ = ["DEFAULT_MAX_EVENT_BYTES", "SSEDecoder"]

DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024

_BOM = b"\xef\xbb\xbf"
_LF = 10
_CR = 13
# A block that is one comment line (a keep-alive), after a blank line: it does nothing.
_COMMENT_BLOCK = re.compile(rb"\n\n:[^\n]*(?=\n\n|\Z)")


class SSEDecoder:
    """Feed raw response bytes, read by read, to :meth:`feed_data`."""

    __slots__ = ("_at_start", "_head", "_max", "_parts", "_parts_size", "_rest", "_skip_lf",
                 "_special", "progress")  # fmt: skip

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError("max_event_bytes must be at least 1")
        self._max = max_event_bytes
        self._at_start = True  # a BOM may still come
        self._head = b""  # the first bytes of the stream while the BOM is undecided
        self._skip_lf = False  # the previous read ended with CR
        self._special = True  # _at_start or _skip_lf: feed_data() must call _normalize()
        # The unfinished event (never starts with LF, never holds a blank line): ``_rest``,
        # or, once reads without a boundary were added to it, the pieces in ``_parts``.
        self._rest = b""
        self._parts: list[bytes] = []
        self._parts_size = 0
        self.progress = 0  # reads that completed an event or a comment

    @property
    def unfinished(self) -> int:
        """Bytes of the event begun and not ended yet (after line-end normalisation)."""
        return self._parts_size if self._parts else len(self._rest)

    def feed_data(self, data: bytes) -> list[bytes]:
        """Decode one read; return the data of each event it completed (often none or
        one), whatever its type, as UTF-8 bytes that are not validated:
        ``.decode("utf-8", "replace")`` gives the event's data. Builds no objects and
        decodes nothing when the read holds only plain ``data:`` events and comments."""
        if self._special or _CR in data:
            data = self._normalize(data)
        cut = data.rfind(b"\n\n")  # the complete events end at the last blank line
        if cut < 0 and not (data[:1] == b"\n" and self._rest_ends_with_lf()):
            self._keep(data)
            return []
        rest = self._join_parts() if self._parts else self._rest
        self._rest = tail = data[cut + 2 :]
        if rest:  # cut == -1 when the blank line is the LF that opens this read
            block = rest + data[:cut] if cut >= 0 else rest[:-1]
        else:
            block = data[:cut] if cut > 0 else b""
        limit = self._max
        if len(tail) > limit:
            self._check_rest()
        if not block or (block[0] == _LF and not block.strip(b"\n")):
            return []  # blank lines only
        self.progress += 1
        if len(block) > limit:
            self._check_events(block)
        if block[:6] == b"data: " and _LF not in (field := block[6:]):  # one plain event
            return [field]
        return self._events(block)

    def _events(self, complete: bytes) -> list[bytes]:
        """The data of the complete events (without their closing blank line)."""
        if complete[:1] == b":" or b"\n\n:" in complete:  # drop comment-only blocks
            complete = _COMMENT_BLOCK.sub(b"", b"\n\n" + complete).lstrip(b"\n")
        if complete[:6] == b"data: ":
            fields = complete[6:].split(b"\n\ndata: ")
            if complete.count(_LF) == 2 * len(fields) - 2:  # every LF is in a separator
                return fields
        if not complete:
            return []
        return [data.encode() for data in _interpret(complete.decode("utf-8", "replace"))]

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
        self._rest, self._parts, self._parts_size = b"", [], 0  # memory stays bounded
        raise EventTooLargeError(
            f"SSE event of {size} bytes or more exceeds the limit of "
            f"max_event_bytes={self._max} bytes",
            detail={"limit": self._max, "size": size},
        )


def _interpret(text: str) -> list[str]:
    """The spec's line-by-line reading of complete events (LF-only ``text`` without the
    closing blank line): the data of each event that has a data line."""
    events: list[str] = []
    data: list[str] = []
    for line in text.split("\n"):
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line[:4] == "data" and line[4:5] in ("", ":"):
            value = line[5:]
            data.append(value[1:] if value[:1] == " " else value)
    if data:
        events.append("\n".join(data))
    return events
