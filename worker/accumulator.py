"""Fold ``chat.completion.chunk`` data into the final message and the deltas to publish.

Pure and on the hot path: :meth:`Accumulator.fold_all` takes the data fields of one
upstream read as raw bytes (``SSEDecoder.feed_data``), :meth:`Accumulator.take_delta`
returns what they added as one :class:`Delta` to publish, :meth:`Accumulator.finish` the
final message. No I/O; chunks are the plain dicts ``pydantic_core.from_json`` returns.

Where the rules live: :class:`Message`, a choice's output merged so far, is the only
code that merges. The accumulator keeps one per choice and routes each chunk's validated
fields to its methods; ``Message.take`` renders what was merged since the last take (the
published delta) and ``Message.final`` the whole (the record); :meth:`Delta.merge` (the
publisher coalescing deltas, a consumer rebuilding the reply) merges published deltas with
the same methods. The fast path (a chunk whose only effect is a string appended to choice
0's content, to a call's arguments or to the last reasoning entry, found by a few type
checks or by a template match, ``worker/template.py``) skips validation and routing, not
the merge.

Rules (the seeds, plus what OpenAI / OpenRouter-style providers really send):

* ``role`` is set once; a repeated role is neither duplicated nor published again.
* ``content`` and ``refusal`` fragments concatenate in order; ``null`` never erases.
* ``tool_calls`` fragments merge by ``index``: ``id``, ``type`` and ``function.name`` keep
  the first non-empty value, ``function.arguments`` concatenate (an object is serialised
  to compact JSON). A fragment without ``index`` joins the call with the same ``id``;
  else, if it carries a new ``id`` while the last call already has one, it starts a new
  call; else it joins the last call (the first when there is none). Fragments that carry
  nothing are dropped; published fragments always carry the resolved index.
* ``reasoning_details``: a fragment joins the last entry when both have the same
  ``type`` (not ``reasoning.encrypted``), their ``index`` is equal (or either has none)
  and the entry has no ``signature`` yet (a signature ends its block, so two signed
  blocks never merge); joining concatenates ``text`` / ``summary`` and keeps the first
  non-null value of every other key. A delta without ``reasoning_details`` may carry
  ``reasoning`` (OpenRouter) or ``reasoning_content`` (DeepSeek, vLLM) as a plain string:
  a ``reasoning.text`` fragment. A published fragment carries its entry's other keys.
* ``n > 1``: each choice (``choices[].index``) accumulates on its own; choice 0 is the
  top level of the delta and of the final message, the others are under ``choices``.
* ``usage``, ``web_search``, ``free_tier``: the last non-null value (never summed).
  ``completion_id`` / ``model``: from the first chunk that has them.
* A UTF-16 surrogate pair split across chunks as escapes (``"\\ud83d"``, ``"\\ude00"``)
  is one character; a lone surrogate becomes U+FFFD. Until its choice ends, a trailing
  high surrogate waits (unpublished) for its other half.
* A chunk with a top-level ``error`` (not ``null``, ``false``, ``""`` or ``{}``) ends the
  stream: its output is still folded, the error recorded (a non-object error becomes
  ``{"message": str(error)}``). A ``finish_reason`` of ``"error"`` without an error
  object also ends as ``"error"``; an empty ``finish_reason`` never replaces one.
* After ``[DONE]`` (only as the whole data field) or an error chunk, data is ignored.
* Anything structurally wrong (invalid JSON, a chunk that is not an object, a content that
  is not a string, ...) raises :class:`~worker.errors.ProtocolError`; no other exception
  escapes. What was folded before it can still be taken.

``FinalMessage.exception()`` maps the outcome to the error tree: ``"error"`` ->
:class:`~worker.errors.MidStreamError` (terminal, partial output kept), ``"truncated"`` ->
:class:`~worker.errors.TruncatedStreamError` (retryable), else ``None``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic_core import from_json

from schemas.jobs import EXTRAS
from worker.errors import MidStreamError, ProtocolError, TruncatedStreamError, snippet
from worker.template import ChunkTemplate, Path, is_clean, learn

DONE = b"[DONE]"
ENCRYPTED = "reasoning.encrypted"
CONCAT = ("text", "summary")  # the reasoning keys that concatenate
End = Literal["done", "complete", "truncated", "error"]


def _bad(what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{what}, got {type(value).__name__}: {snippet(repr(value))}")


# --- the merge rules ----------------------------------------------------------------------


def _joins(entry: dict[str, Any], fragment: dict[str, Any]) -> bool:
    """Whether a reasoning fragment continues ``entry`` rather than starting a new one."""
    kind = entry.get("type")
    if kind != fragment.get("type") or kind == ENCRYPTED or "signature" in entry:
        return False
    a, b = entry.get("index"), fragment.get("index")
    return a is None or b is None or a == b


def _cut(parts: list[str], at: int, fix: bool, ended: bool) -> tuple[str, int]:
    """The text of ``parts[at:]`` and where the next cut starts. With ``fix`` (a chunk
    may have had lone surrogates), pairs are joined and lone ones become U+FFFD, except a
    trailing high surrogate: until ``ended`` it stays in ``parts``, unread, for its pair."""
    text = parts[at] if len(parts) == at + 1 else "".join(parts[at:])
    if not fix:
        return text, len(parts)
    if not ended and text and "\ud800" <= text[-1] <= "\udbff":
        last = parts.pop()
        parts += [last[:-1], last[-1]] if len(last) > 1 else [last]
        return _utf16(text[:-1]), len(parts) - 1
    return _utf16(text), len(parts)


def _cut_into(
    out: dict[str, Any],
    key: str,
    parts: list[str],
    at: int,
    fix: bool,
    ended: bool,
    *,
    empty: bool = False,
) -> int:
    """:func:`_cut` into ``out[key]`` (unless empty and not ``empty``); the next start."""
    text, at = _cut(parts, at, fix, ended)
    if text or empty:
        out[key] = text
    return at


def _utf16(text: str) -> str:
    """Surrogate pairs joined into one character, lone surrogates as U+FFFD."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class _Call:
    """One tool call merged so far; ``fresh``: id, type or name set since the last take."""

    __slots__ = ("args", "args_at", "fresh", "id", "name", "type")

    def __init__(self) -> None:
        self.id = self.type = self.name = ""
        self.args: list[str] = []
        self.args_at = 0  # parts taken
        self.fresh = False

    def take(self, index: int, fix: bool, ended: bool) -> dict[str, Any] | None:
        if not self.fresh and len(self.args) == self.args_at:
            return None
        fragment: dict[str, Any] = {"index": index}
        function: dict[str, str] = {}
        if self.fresh:
            fragment.update((k, v) for k, v in (("id", self.id), ("type", self.type)) if v)
            if self.name:
                function["name"] = self.name
            self.fresh = False
        args, self.args_at = _cut(self.args, self.args_at, fix, ended)
        if args:
            function["arguments"] = args
        if function:
            fragment["function"] = function
        return fragment if len(fragment) > 1 else None

    def final(self, fix: bool, ended: bool) -> dict[str, Any]:
        arguments = _cut(self.args, 0, fix, ended)[0]
        function = {"name": self.name, "arguments": arguments}
        return {"id": self.id, "type": self.type or "function", "function": function}


_UNTAKEN = (0, 0, 0)  # nothing of an entry taken (see _take_entry)


def _take_entry(
    entry: dict[str, Any], taken: tuple[int, int, int], fix: bool, ended: bool
) -> tuple[dict[str, Any] | None, tuple[int, int, int]]:
    """A reasoning entry's fragment since ``taken`` (its size, its text and summary parts
    taken), with its other keys, so that it joins the entry again when merged; and the new
    ``taken``."""
    size, text_at, summary_at = taken
    text, summary, fresh = entry.get("text"), entry.get("summary"), len(entry) != size
    if not (fresh or len(text or ()) > text_at or len(summary or ()) > summary_at):
        return None, taken
    fragment = {key: value for key, value in entry.items() if key not in CONCAT}
    if text is not None:
        text_at = _cut_into(fragment, "text", text, text_at, fix, ended, empty=fresh)
    if summary is not None:
        summary_at = _cut_into(fragment, "summary", summary, summary_at, fix, ended, empty=fresh)
    if not fresh and len(fragment) == size - (text is not None) - (summary is not None):
        return None, (size, text_at, summary_at)  # only a surrogate's first half arrived
    return fragment, (len(entry), text_at, summary_at)


class Message:
    """One choice's output merged so far (choice 0's also holds the others in ``choices``).

    The merge rules, once: ``set_role``, ``add`` (a delta in the published form),
    ``add_reasoning`` and ``add_call``. Text is kept as parts, joined once when rendered.
    """

    __slots__ = (
        "_content_at",
        "_entry_at",
        "_entry_taken",
        "_refusal_at",
        "_role_taken",
        "calls",
        "choices",
        "content",
        "finish_reason",
        "ids",
        "last_call",
        "reasoning",
        "refusal",
        "role",
    )

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.reasoning: list[dict[str, Any]] = []  # entries; CONCAT values as parts
        self.calls: dict[int, _Call] = {}
        self.ids: dict[str, int] = {}  # call id -> index
        self.last_call: int | None = None
        self.choices: dict[int, Message] = {}
        self.finish_reason: str | None = None  # not published: the terminal entry has it
        self._role_taken = False
        self._content_at = self._refusal_at = 0  # parts taken
        self._entry_at, self._entry_taken = 0, _UNTAKEN  # the last entry at the last take

    def choice(self, index: int) -> Message:
        return self if index == 0 else self.choices.setdefault(index, Message())

    def set_role(self, role: str) -> None:
        if self.role is None:
            self.role = role

    def add(self, delta: dict[str, Any]) -> None:
        """Merge a delta in the published form (docs/events.md); no validation."""
        if delta.get("role"):
            self.set_role(delta["role"])
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("refusal"):
            self.refusal.append(delta["refusal"])
        for fragment in delta.get("reasoning_details", ()):
            self.add_reasoning(fragment)
        for call in delta.get("tool_calls", ()):
            function = call.get("function") or {}
            name, args = function.get("name"), function.get("arguments")
            self.add_call(call["index"], call.get("id"), call.get("type"), name, args)
        for choice in delta.get("choices", ()):
            self.choice(choice["index"]).add(choice)

    def add_reasoning(self, fragment: dict[str, Any]) -> None:
        """A fragment without null values."""
        entries = self.reasoning
        if not entries or not _joins(entries[-1], fragment):
            entries.append({k: [v] if k in CONCAT else v for k, v in fragment.items()})
            return
        entry = entries[-1]
        for key, value in fragment.items():
            if key in CONCAT:
                entry.setdefault(key, []).append(value)
            elif key not in entry:
                entry[key] = value

    def add_call(
        self, index: int, cid: str | None, kind: str | None, name: str | None, args: str | None
    ) -> bool:
        """Merge a tool-call fragment; False when it carries nothing (and is dropped)."""
        call = self.calls.get(index)
        if call is None:
            if not (cid or kind or name or args):
                return False
            call = self.calls[index] = _Call()
        if cid and not call.id:
            call.id, call.fresh = cid, True
            self.ids.setdefault(cid, index)
        if kind and not call.type:
            call.type, call.fresh = kind, True
        if name and not call.name:
            call.name, call.fresh = name, True
        if args:
            call.args.append(args)
        self.last_call = index
        return True

    def take(self, fix: bool, closed: bool) -> Delta:
        """What was merged since the last take, in the published form (every key
        non-empty); ``fix`` and ``closed`` as in :func:`_cut` (see ``Accumulator``)."""
        out = Delta()
        ended = closed or self.finish_reason is not None
        if self.role is not None and not self._role_taken:
            out["role"] = self.role
            self._role_taken = True
        if len(self.content) > self._content_at:
            self._content_at = _cut_into(out, "content", self.content, self._content_at, fix, ended)
        if len(self.refusal) > self._refusal_at:
            self._refusal_at = _cut_into(out, "refusal", self.refusal, self._refusal_at, fix, ended)
        if self.reasoning:
            self._take_reasoning(out, fix, ended)
        if self.calls:
            calls = [f for i, call in self.calls.items() if (f := call.take(i, fix, ended))]
            if calls:
                out["tool_calls"] = calls
        if self.choices:
            self._take_choices(out, fix, closed)
        return out

    def _take_reasoning(self, out: Delta, fix: bool, ended: bool) -> None:
        entries, fragments = self.reasoning, []
        last, taken = len(entries) - 1, self._entry_taken
        for position in range(self._entry_at, last + 1):
            entry = entries[position]
            closed = ended or position < last or "signature" in entry
            fragment, taken = _take_entry(entry, taken, fix, closed)
            if fragment is not None:
                fragments.append(fragment)
            if position < last:
                taken = _UNTAKEN
        self._entry_at, self._entry_taken = last, taken
        if fragments:
            out["reasoning_details"] = fragments

    def _take_choices(self, out: Delta, fix: bool, closed: bool) -> None:
        others = sorted(self.choices.items())
        choices = [{"index": i, **d} for i, m in others if (d := m.take(fix, closed))]
        if choices:
            out["choices"] = choices

    def final(self, fix: bool, closed: bool) -> dict[str, Any]:
        """The whole output: role, content, refusal, reasoning, tool_calls, finish_reason."""
        ended = closed or self.finish_reason is not None
        return {
            "role": self.role or "assistant",
            "content": _cut(self.content, 0, fix, ended)[0],
            "refusal": _cut(self.refusal, 0, fix, ended)[0],
            "reasoning": [
                _final_entry(entry, fix, ended or entry is not self.reasoning[-1])
                for entry in self.reasoning
            ],
            "tool_calls": [self.calls[i].final(fix, ended) for i in sorted(self.calls)],
            "finish_reason": self.finish_reason,
        }


def _final_entry(entry: dict[str, Any], fix: bool, ended: bool) -> dict[str, Any]:
    ended = ended or "signature" in entry
    return {k: _cut(v, 0, fix, ended)[0] if k in CONCAT else v for k, v in entry.items()}


class Delta(dict[str, Any]):
    """A published delta: its JSON form (docs/events.md). ``merge`` coalesces a later one
    into it by the :class:`Message` rules, so merging in any grouping gives the same."""

    def merge(self, other: dict[str, Any]) -> None:
        merged = Message()
        merged.add(self)
        merged.add(other)
        self.clear()
        self.update(merged.take(False, True))

    def to_json(self) -> dict[str, Any]:
        return self


# --- final message ------------------------------------------------------------------------


@dataclass
class FinalMessage:
    """Choice 0's output (the record's top-level fields), the stream's trailers, ``choices``
    (n > 1: the other choices' :meth:`Message.final` with their ``index``) and ``end``."""

    role: str
    content: str
    refusal: str
    reasoning: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]  # {"id", "type", "function": {"name", "arguments"}}
    finish_reason: str | None
    choices: list[dict[str, Any]] | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    completion_id: str | None
    model: str | None
    extras: dict[str, Any]  # EXTRAS that arrived
    end: End

    def exception(self) -> MidStreamError | TruncatedStreamError | None:
        """The error this outcome stands for: error -> MidStreamError, truncated -> retryable."""
        if self.end == "truncated":
            return TruncatedStreamError("the stream ended with neither [DONE] nor a finish_reason")
        if self.end != "error":
            return None
        error = self.error or {}
        message = error.get("message")
        code = error.get("code")
        return MidStreamError(
            message if isinstance(message, str) and message else "upstream mid-stream error",
            status=code if type(code) is int else None,
            detail=error,
        )


# --- reading chunks -----------------------------------------------------------------------


class _Fast(NamedTuple):
    """What a fast chunk appends to: ``kind`` "text" (choice 0's content), "args" (call
    ``call``) or "reasoning" (``key`` of ``entry``, the last entry, which ``fragment``
    joins without adding a key)."""

    kind: str
    call: int = 0
    entry: dict[str, Any] | None = None
    fragment: dict[str, Any] | None = None
    key: str = "text"


_TEXT = _Fast("text")
_SKIP: Any = object()  # _parse(): nothing to fold
_TRAILERS = ("usage", *EXTRAS)
_TEXT_DELTA = frozenset({"content", "role", "refusal"})
_ARGS_DELTA = frozenset({"tool_calls", "content", "role", "refusal"})
_REASONING_DELTA = frozenset({"reasoning_details", "reasoning", "reasoning_content", *_ARGS_DELTA})
# templates (worker/template.py): where a fast kind's value sits; string fields never
# read that may change from chunk to chunk (the first two usually hold the value itself)
_DELTA: Path = ("choices", 0, "delta")
_ARGS_PATH: Path = (*_DELTA, "tool_calls", 0, "function", "arguments")
_IGNORED: tuple[Path, ...] = ((*_DELTA, "reasoning"), (*_DELTA, "reasoning_content"))
_RANDOM: tuple[Path, ...] = (("obfuscation",),)
# where a chunk's text fragments sit: their lone surrogates wait for the join (see _valid)
_TEXT_PATHS: dict[str, Any] = {"choices": {"*": {"delta": {
    "content": True, "refusal": True, "reasoning": True, "reasoning_content": True,
    "reasoning_details": {"*": {"text": True, "summary": True}},
    "tool_calls": {"*": {"function": {"arguments": True}}},
}}}}  # fmt: skip


def _valid(node: Any, texts: Any) -> Any:
    """``node`` with every lone surrogate made U+FFFD (pairs joined), in keys and strings,
    except in the strings at ``texts`` paths (True), which the join fixes."""
    if isinstance(node, str):
        return node if texts is True else _utf16(node)
    paths = texts if isinstance(texts, dict) else {}
    if isinstance(node, list):
        return [_valid(item, paths.get("*")) for item in node]
    if isinstance(node, dict):
        return {_utf16(key): _valid(value, paths.get(key)) for key, value in node.items()}
    return node


def _only(delta: dict[str, Any], keys: frozenset[str]) -> bool:
    """Whether ``delta`` has no key but ``keys`` that is not null."""
    if len(delta) == 1 or delta.keys() <= keys:
        return True
    return all(value is None for key, value in delta.items() if key not in keys)


def _str_or_none(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _bad(f"{what} must be a string", value)


def _arguments(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    raise _bad("tool call function.arguments must be a string or an object", value)


def _clean_reasoning(fragment: Any) -> dict[str, Any]:
    if not isinstance(fragment, dict):
        raise _bad("a reasoning_details entry must be an object", fragment)
    out = {k: v for k, v in fragment.items() if v is not None}
    for key in ("type", *CONCAT):
        _str_or_none(out.get(key), f"reasoning_details {key}")
    return out


def _reasoning_fragments(delta: dict[str, Any]) -> list[Any]:
    details = delta.get("reasoning_details")
    if details:
        if not isinstance(details, list):
            raise _bad("delta.reasoning_details must be a list", details)
        return details
    text = delta.get("reasoning")
    if text is None:
        text = delta.get("reasoning_content")
    if _str_or_none(text, "delta.reasoning"):
        return [{"type": "reasoning.text", "text": text}]
    return []


def _resolve_index(message: Message, index: Any, cid: str | None) -> int:
    if index is not None:
        if type(index) is not int or index < 0:
            raise _bad("tool call index must be a non-negative integer", index)
        return index
    if cid and cid in message.ids:
        return message.ids[cid]
    last = message.last_call
    if last is None:
        return 0
    if cid and message.calls[last].id:
        return max(message.calls) + 1
    return last


class Accumulator:
    """Folds one stream's SSE data fields into published deltas and the final message."""

    def __init__(self) -> None:
        self._message = Message()  # choice 0; the other choices in its .choices
        self._closed = False  # [DONE] or an error arrived: ignore everything after
        self._done = False
        self._error: dict[str, Any] | None = None
        self._usage: dict[str, Any] | None = None
        self._extras: dict[str, Any] = {}
        self._completion_id: str | None = None
        self._model: str | None = None
        self._lenient = False  # a chunk was read by json.loads: text may hold lone surrogates
        # the template of the latest fast chunk; learning attempts; chunks parsed, and
        # chunks that added output (parsed or matched)
        self._template: ChunkTemplate[_Fast] | None = None
        self._learns = self._parsed = self._folded = 0

    @property
    def closed(self) -> bool:
        """``[DONE]`` or an error chunk arrived: the stream is over."""
        return self._closed

    @property
    def truncated(self) -> bool:
        """Neither closed nor a finish_reason for every choice (yet)."""
        return not self._closed and not self._all_finished()

    def _all_finished(self) -> bool:
        message = self._message
        finished = message.finish_reason is not None
        return finished and all(m.finish_reason is not None for m in message.choices.values())

    def fold_all(self, fields: Iterable[bytes]) -> int:
        """Fold the data fields of one read (raw bytes, as ``SSEDecoder.feed_data`` returns
        them) in order; return how many added output. A field that matches the template of
        the stream's repetitive chunks is folded without parsing it."""
        added = 0
        for data in fields:
            template = self._template
            if (
                template is not None
                and (value := template.match(data)) is not None
                and self._fold_fast(template.key, value)
            ):
                added += 1
            else:
                added += self._fold_parsed(data)
        self._folded += added
        return added

    def take_delta(self) -> Delta | None:
        """Everything folded since the last call, as one delta to publish (None: nothing)."""
        return self._message.take(self._lenient, self._closed) or None

    def finish(self) -> FinalMessage:
        """The final message so far (may be called at any time, any number of times)."""
        error = self._error
        finish_reasons = [self._message.finish_reason]
        finish_reasons += [m.finish_reason for m in self._message.choices.values()]
        if error is None and "error" in finish_reasons:
            error = {"message": "the upstream ended the stream with finish_reason 'error'"}
        end: End = "error" if error is not None else "done" if self._done else "complete"
        if end == "complete" and not self._all_finished():
            end = "truncated"
        final = self._message.final(self._lenient, self._closed)
        others = self._message.choices.items()
        choices = [{"index": i, **m.final(self._lenient, self._closed)} for i, m in others]
        return FinalMessage(
            **final,
            choices=sorted(choices, key=lambda c: int(c["index"])) or None,
            usage=self._usage,
            error=error,
            completion_id=self._completion_id,
            model=self._model,
            extras=dict(self._extras),
            end=end,
        )

    # reading

    def _fold_parsed(self, data: bytes) -> bool:
        if self._closed:
            return False
        chunk = self._parse(data)
        if chunk is _SKIP:
            return False
        self._parsed += 1
        fast = self._fast(chunk)
        if fast is None:
            return self._fold_chunk(chunk)
        self._fold_fast(*fast)
        self._learn(data, chunk, *fast)
        return True

    def _parse(self, data: bytes) -> Any:
        """The decoded chunk, or _SKIP for ``[DONE]`` and blank data."""
        if data == DONE:
            self._done = True
            self._close()
            return _SKIP
        try:
            return from_json(data)
        except (ValueError, RecursionError):
            return self._parse_leniently(data)

    def _parse_leniently(self, data: bytes) -> Any:
        """What jiter refuses and ``json.loads`` reads: lone surrogate escapes (see _valid)
        and invalid UTF-8 (as U+FFFD, as the SSE events have it)."""
        text = data.decode("utf-8", "replace")
        if not text.strip():
            return _SKIP
        try:
            chunk = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"invalid JSON in SSE data: {snippet(text)}") from exc
        self._lenient = True
        return _valid(chunk, _TEXT_PATHS)

    def _close(self) -> None:
        """[DONE] or an error: everything after it is ignored, templates included."""
        self._closed = True
        self._template = None

    # the fast path: one string appended

    def _fold_fast(self, fast: _Fast, value: str) -> bool:
        """Append ``value`` where ``fast`` says; False (and the template dropped) when the
        reasoning entry it continued no longer takes fragments."""
        message = self._message
        if fast.kind == "text":
            message.content.append(value)
        elif fast.kind == "args":
            message.add_call(fast.call, None, None, None, value)
        else:
            entry, fragment = message.reasoning[-1], fast.fragment
            if entry is not fast.entry or fragment is None or not _joins(entry, fragment):
                self._template = None
                return False
            entry[fast.key].append(value)
        return True

    def _fast(self, chunk: Any) -> tuple[_Fast, str] | None:
        """A chunk whose only effect is one string appended to choice 0's content, to a
        call's arguments or to the last reasoning entry; None: the general path decides
        (with the same result)."""
        delta = self._plain_delta(chunk)
        if delta is None:
            return None
        content = delta.get("content")
        if content:
            return (_TEXT, content) if type(content) is str and _only(delta, _TEXT_DELTA) else None
        if content is not None and content != "":
            return None
        tools, details = delta.get("tool_calls"), delta.get("reasoning_details")
        if type(tools) is list and len(tools) == 1 and _only(delta, _ARGS_DELTA):
            return self._fast_args(tools[0])
        if type(details) is list and len(details) == 1 and _only(delta, _REASONING_DELTA):
            return self._fast_reasoning(details[0])
        return None

    def _plain_delta(self, chunk: Any) -> dict[str, Any] | None:
        """The delta of a chunk with one choice (0), no finish_reason, null trailers, ids
        already known, no refusal and a role that changes nothing."""
        if type(chunk) is not dict or self._model is None or self._completion_id is None:
            return None
        get = chunk.get
        choices = get("choices")
        if (
            get("error")
            or any(get(key) is not None for key in _TRAILERS)
            or type(choices) is not list
            or len(choices) != 1
        ):
            return None
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return None
        delta, index = choice.get("delta"), choice.get("index")
        if type(delta) is not dict or not (index is None or (type(index) is int and index == 0)):
            return None
        role = delta.get("role")
        if role is not None and (type(role) is not str or self._message.role is None):
            return None
        return delta if delta.get("refusal") is None else None

    def _fast_args(self, fragment: Any) -> tuple[_Fast, str] | None:
        """``{"index": i, "function": {"arguments": "..."}}`` for a call already open."""
        if type(fragment) is not dict or len(fragment) != 2:
            return None
        index, function = fragment.get("index"), fragment.get("function")
        if type(index) is not int or index not in self._message.calls:
            return None
        if type(function) is not dict or len(function) != 1:
            return None
        args = function.get("arguments")
        return (_Fast("args", call=index), args) if type(args) is str and args else None

    def _fast_reasoning(self, fragment: Any) -> tuple[_Fast, str] | None:
        """A text or summary fragment that joins the last entry and adds no other key."""
        entries = self._message.reasoning
        if type(fragment) is not dict or not entries:
            return None
        key = "text" if "text" in fragment else "summary"
        value, entry = fragment.get(key), entries[-1]
        if type(value) is not str or not value or key not in entry or not _joins(entry, fragment):
            return None
        for other, known in fragment.items():
            if other != key and known is not None and entry.get(other) != known:
                return None
        return _Fast("reasoning", entry=entry, fragment=fragment, key=key), value

    def _learn(self, data: bytes, chunk: Any, fast: _Fast, value: str) -> None:
        """Learn the template of a fast chunk. An attempt costs several parses, so they are
        rationed: 8, then one per 16 chunks that templates folded and one per 256 parsed
        chunks. A stream whose chunks never repeat pays a few percent for them."""
        if not is_clean(value):
            return
        matched = self._folded - self._parsed  # about: parsed chunks may add nothing
        if self._learns >= 8 + max(matched, 0) // 16 + self._parsed // 256:
            self._template = None  # it missed this chunk: stop trying it until a new one
            return
        self._learns += 1
        if fast.kind == "text":
            want: Path = (*_DELTA, "content")
        elif fast.kind == "args":
            want = _ARGS_PATH
        else:
            want = (*_DELTA, "reasoning_details", 0, fast.key)
        template = learn(data, chunk, want, _IGNORED, _RANDOM, fast)
        if template is not None:
            self._template = template

    # the general path: validate, route to the Message rules

    def _fold_chunk(self, chunk: Any) -> bool:
        if not isinstance(chunk, dict):
            raise _bad("a chunk must be a JSON object", chunk)
        self._take_ids(chunk)
        choices = chunk.get("choices")
        added = False
        if choices is not None:
            if not isinstance(choices, list):
                raise _bad("choices must be a list", choices)
            for choice in choices:
                added |= self._fold_choice(choice)
        self._take_trailer(chunk)
        return added

    def _take_ids(self, chunk: dict[str, Any]) -> None:
        cid, model = chunk.get("id"), chunk.get("model")
        if self._completion_id is None and type(cid) is str and cid:
            self._completion_id = cid
        if self._model is None and type(model) is str and model:
            self._model = model

    def _take_trailer(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise _bad("usage must be an object", usage)
            self._usage = usage
        for key in EXTRAS:
            value = chunk.get(key)
            if value is not None:
                self._extras[key] = value
        error = chunk.get("error")
        if error:
            self._error = error if isinstance(error, dict) else {"message": str(error)}
            self._close()

    def _fold_choice(self, choice: Any) -> bool:
        if not isinstance(choice, dict):
            raise _bad("a choice must be an object", choice)
        index = choice.get("index")
        if index is not None and (type(index) is not int or index < 0):
            raise _bad("a choice index must be a non-negative integer", index)
        message = self._message.choice(index or 0)
        reason = _str_or_none(choice.get("finish_reason"), "finish_reason")
        if reason:
            message.finish_reason = reason
        delta = choice.get("delta")
        if delta is None:
            return False
        if not isinstance(delta, dict):
            raise _bad("a choice's delta must be an object", delta)
        return self._fold_delta(message, delta)

    def _fold_delta(self, message: Message, delta: dict[str, Any]) -> bool:
        """Validate a delta into the published form and merge it; whether it had output."""
        clean: dict[str, Any] = {}
        for key in ("role", "content", "refusal"):
            value = _str_or_none(delta.get(key), f"delta.{key}")
            if value:
                clean[key] = value
        fragments = [_clean_reasoning(f) for f in _reasoning_fragments(delta)]
        if fragments:
            clean["reasoning_details"] = fragments
        message.add(clean)
        added = len(clean) > ("role" in clean)
        tools = delta.get("tool_calls")
        if tools:
            if not isinstance(tools, list):
                raise _bad("delta.tool_calls must be a list", tools)
            for raw in tools:
                added |= self._fold_call(message, raw)
        return added

    def _fold_call(self, message: Message, raw: Any) -> bool:
        if not isinstance(raw, dict):
            raise _bad("a tool_calls entry must be an object", raw)
        function = raw.get("function")
        if function is None:
            function = {}
        elif not isinstance(function, dict):
            raise _bad("tool call function must be an object", function)
        cid = _str_or_none(raw.get("id"), "tool call id")
        kind = _str_or_none(raw.get("type"), "tool call type")
        name = _str_or_none(function.get("name"), "tool call function.name")
        args = _arguments(function.get("arguments"))
        index = _resolve_index(message, raw.get("index"), cid)
        return message.add_call(index, cid, kind, name, args)
