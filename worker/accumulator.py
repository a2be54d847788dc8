"""Fold ``chat.completion.chunk`` objects into the final message and the deltas to publish.

Pure and on the hot path: it takes the ``data`` field of each SSE event (or an already
decoded chunk dict), never does I/O and works on the plain dicts ``json.loads`` returns
(the pydantic models in ``schemas.chunks`` document the same shapes for consumers).
``fold_all`` takes a read's data fields as raw bytes; a chunk that matches the template of
the stream's repetitive chunks (``worker/template.py``) is folded without parsing it, with
the same result.

Rules (the seeds, plus what OpenAI / OpenRouter-style providers really send):

* ``role`` is set once; a repeated role is neither duplicated nor published again.
* ``content`` fragments concatenate in order; ``null`` never erases what arrived.
* ``tool_calls`` fragments merge by ``index``: ``id``, ``type`` and ``function.name`` keep
  the first non-empty value (never concatenated), ``function.arguments`` concatenate, and
  arguments sent as a JSON object are serialised to a compact JSON string. A fragment
  without ``index`` joins the call with the same ``id``; else, if it carries a new ``id``
  while the last call already has one, it starts a new call; else it joins the last call
  (the first call when there is none). Published deltas always carry the resolved index.
  Fragments that carry nothing (no id, type, name or arguments) are dropped.
* ``reasoning_details``: a fragment joins the previous entry when both have the same
  ``type`` and their ``index`` (when both have one) is equal; joining concatenates
  ``text`` / ``summary`` and keeps the first non-null value of every other key
  (``signature``, ``format``, ``id``, ...). ``reasoning.encrypted`` entries never join.
  A delta without ``reasoning_details`` may carry ``reasoning`` (OpenRouter) or
  ``reasoning_content`` (DeepSeek / vLLM) as a plain string: it becomes a
  ``reasoning.text`` fragment. Published fragments carry the entry's index when they
  join an indexed entry, so merging published deltas reproduces the same entries.
* ``usage``: the last non-null value wins (never summed). ``web_search`` and
  ``free_tier``: the last non-null value wins, kept in ``FinalMessage.extras``.
* ``completion_id`` / ``model``: from the first chunk that has them.
* A chunk with a top-level ``error`` ends the stream: its partial delta (if any) is still
  returned, the error is recorded (a non-object error becomes ``{"message": str(error)}``)
  and ``finish().end == "error"``. ``null`` (or another empty value: ``false``, ``""``,
  ``{}``) is not an error. A ``finish_reason`` of ``"error"`` without an error object also
  ends as ``"error"``. An empty ``finish_reason`` never replaces an earlier one.
* After ``[DONE]`` (only as the whole data field) or an error chunk, further data is
  ignored (``feed_data`` / ``add_chunk`` return ``None`` without parsing it).
* Only choice index 0 is accumulated; ``n > 1`` is unsupported and other choices are
  ignored.
* Anything structurally wrong (invalid JSON, a chunk that is not an object, ``choices``
  not a list, ``delta`` not an object, a content that is not a string, ...) raises
  :class:`~worker.errors.ProtocolError`; no other exception escapes.

``FinalMessage.exception()`` maps the outcome to the error tree: ``"error"`` ->
:class:`~worker.errors.MidStreamError` (terminal, partial output kept), ``"truncated"`` ->
:class:`~worker.errors.TruncatedStreamError` (retryable), else ``None``.

``Delta.merge`` applies the same rules, so coalescing published deltas in any grouping and
merging them in order yields the final content, reasoning and tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic_core import from_json

from worker.errors import MidStreamError, ProtocolError, TruncatedStreamError, snippet
from worker.template import ChunkTemplate, Path, is_clean, learn

DONE = "[DONE]"
_DONE_BYTES = DONE.encode()
ENCRYPTED = "reasoning.encrypted"
_CONCAT_KEYS = frozenset({"text", "summary"})
_EXTRA_KEYS = ("web_search", "free_tier")
# a chunk with any of these keys takes the general path
_TRAILER_KEYS = frozenset({"usage", "error", *_EXTRA_KEYS})
_ARGS_ONLY = frozenset({"arguments"})
_SKIP: Any = object()  # _parse(): nothing to fold
_REASONING_DELTA_KEYS = frozenset(
    {"reasoning_details", "reasoning", "reasoning_content", "content", "role"}
)

End = Literal["done", "complete", "truncated", "error"]

# chunk templates (worker/template.py): where each fast kind's value sits, and string
# fields the accumulator never reads that may change from chunk to chunk
_DELTA: Path = ("choices", 0, "delta")
_TEMPLATE_VALUE: dict[str, Path] = {
    "text": (*_DELTA, "content"),
    "args": (*_DELTA, "tool_calls", 0, "function", "arguments"),
    "reasoning": (*_DELTA, "reasoning_details", 0, "text"),
}
_TEMPLATE_IGNORED: tuple[Path, ...] = (
    (*_DELTA, "reasoning"),
    (*_DELTA, "reasoning_content"),
    ("obfuscation",),
)


def _bad(what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{what}, got {type(value).__name__}: {snippet(repr(value))}")


# --- merge rules shared by Delta.merge and the Accumulator --------------------------------


def _joins(entry: dict[str, Any], frag: dict[str, Any]) -> bool:
    """Whether a reasoning fragment continues ``entry`` rather than starting a new one."""
    kind = entry.get("type")
    if kind != frag.get("type") or kind == ENCRYPTED:
        return False
    a, b = entry.get("index"), frag.get("index")
    return a is None or b is None or a == b


def _copy_call(call: dict[str, Any]) -> dict[str, Any]:
    copy = dict(call)
    if isinstance(copy.get("function"), dict):
        copy["function"] = dict(copy["function"])
    return copy


# --- Delta --------------------------------------------------------------------------------


@dataclass(slots=True)
class Delta:
    """What one chunk (or several coalesced chunks) adds to the message."""

    role: str | None = None
    content: str = ""
    reasoning_details: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def merge(self, other: Delta) -> None:
        """Coalesce a later delta into this one (same rules as the accumulator)."""
        if self.role is None:
            self.role = other.role
        self.content += other.content
        if other.reasoning_details:
            self.reasoning_details = _merge_all_reasoning(
                [*self.reasoning_details, *other.reasoning_details]
            )
        if other.tool_calls:
            self.tool_calls = _merge_all_tools([*self.tool_calls, *other.tool_calls])

    def is_empty(self) -> bool:
        return not (self.role or self.content or self.reasoning_details or self.tool_calls)

    def to_json(self) -> dict[str, Any]:
        """Compact form: only the non-empty keys."""
        out: dict[str, Any] = {}
        if self.role:
            out["role"] = self.role
        if self.content:
            out["content"] = self.content
        if self.reasoning_details:
            out["reasoning_details"] = self.reasoning_details
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Delta:
        if not isinstance(data, dict):
            raise _bad("a delta must be a JSON object", data)
        role, content = data.get("role"), data.get("content") or ""
        reasoning, tools = data.get("reasoning_details") or [], data.get("tool_calls") or []
        if not (role is None or isinstance(role, str)) or not isinstance(content, str):
            raise _bad("delta role/content must be strings", data)
        if not isinstance(reasoning, list) or not isinstance(tools, list):
            raise _bad("delta reasoning_details/tool_calls must be lists", data)
        if not all(isinstance(r, dict) for r in reasoning) or not all(
            isinstance(t, dict) and isinstance(t.get("index"), int) for t in tools
        ):
            raise _bad("delta fragments must be objects (tool calls with an index)", data)
        return cls(role, content, [dict(r) for r in reasoning], [_copy_call(t) for t in tools])


def merge_all(deltas: list[Delta]) -> Delta:
    """``Delta.merge`` of all ``deltas`` in order, in linear time (text joined once)."""
    role = next((d.role for d in deltas if d.role is not None), None)
    merged = Delta(role, "".join(d.content for d in deltas))
    merged.tool_calls = _merge_all_tools(frag for d in deltas for frag in d.tool_calls)
    merged.reasoning_details = _merge_all_reasoning(
        frag for d in deltas for frag in d.reasoning_details
    )
    return merged


def _merge_all_tools(frags: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    args: dict[int, list[str]] = {}
    for frag in frags:
        index = frag["index"]
        call = calls.get(index)
        if call is None:
            call = calls[index] = _copy_call(frag)
            fn = call.get("function")
            args[index] = [fn.pop("arguments")] if fn and "arguments" in fn else []
            continue
        for key in ("id", "type"):
            if frag.get(key) and not call.get(key):
                call[key] = frag[key]
        fn = frag.get("function")
        if fn:
            dest = call.setdefault("function", {})
            if fn.get("name") and not dest.get("name"):
                dest["name"] = fn["name"]
            if fn.get("arguments"):
                args[index].append(fn["arguments"])
    for index, parts in args.items():
        if parts:
            calls[index].setdefault("function", {})["arguments"] = "".join(parts)
    return list(calls.values())


def _merge_all_reasoning(frags: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    parts: list[dict[str, list[str]]] = []
    for frag in frags:
        if entries and _joins(entries[-1], frag):
            entry, texts = entries[-1], parts[-1]
            for key, value in frag.items():
                if value is None:
                    continue
                if key in _CONCAT_KEYS:
                    texts.setdefault(key, []).append(value)
                elif entry.get(key) is None:
                    entry[key] = value
            continue
        entry = dict(frag)
        entries.append(entry)
        parts.append({key: [entry.pop(key)] for key in _CONCAT_KEYS if entry.get(key) is not None})
    for entry, texts in zip(entries, parts, strict=True):
        for key, values in texts.items():
            entry[key] = "".join(values)
    return entries


# --- final message ------------------------------------------------------------------------


@dataclass
class FinalMessage:
    role: str
    content: str
    reasoning: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]  # {"id", "type", "function": {"name", "arguments"}}
    finish_reason: str | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    completion_id: str | None
    model: str | None
    extras: dict[str, Any]
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


# --- accumulator state --------------------------------------------------------------------


class _Call:
    __slots__ = ("args", "id", "name", "type")

    def __init__(self) -> None:
        self.id = ""
        self.type = ""
        self.name = ""
        self.args: list[str] = []

    def final(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": "".join(self.args)}
        return {"id": self.id, "type": self.type or "function", "function": function}


def _str_or_none(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _bad(f"{what} must be a string", value)


def _arguments(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    raise _bad("tool call function.arguments must be a string or an object", value)


def _clean_reasoning(frag: Any) -> dict[str, Any]:
    if not isinstance(frag, dict):
        raise _bad("a reasoning_details entry must be an object", frag)
    out = {k: v for k, v in frag.items() if v is not None}
    for key in _CONCAT_KEYS.intersection(out):
        _str_or_none(out[key], f"reasoning_details {key}")
    _str_or_none(out.get("type"), "reasoning_details type")
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


def _single_plain_delta(chunk: Any) -> dict[str, Any] | None:
    """The delta of a chunk with one choice, no finish_reason and no trailer."""
    if type(chunk) is not dict or not _TRAILER_KEYS.isdisjoint(chunk):
        return None
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if type(choice) is not dict or choice.get("finish_reason") is not None:
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or choice.get("index", 0) != 0:
        return None
    return delta


class Accumulator:
    """Folds one stream's SSE data fields into published deltas and the final message."""

    def __init__(self) -> None:
        self._closed = False  # [DONE] or an error arrived: ignore everything after
        self._done = False
        self._error: dict[str, Any] | None = None
        self._role: str | None = None
        self._content: list[str] = []
        self._reasoning: list[dict[str, Any]] = []  # text/summary held as list[str] parts
        self._calls: dict[int, _Call] = {}
        self._ids: dict[str, int] = {}
        self._last_call: int | None = None
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._extras: dict[str, Any] = {}
        self._completion_id: str | None = None
        self._model: str | None = None
        # folded by fold(), not yet taken: general deltas, then fast fragments' parts
        self._held: list[Delta] = []
        self._held_text: list[str] = []
        self._held_args: dict[int, list[str]] = {}  # index -> pieces (kept, emptied)
        self._held_reasoning: tuple[dict[str, Any], list[str]] | None = None
        # the template of the latest fast chunk; learning attempts; chunks parsed, and
        # chunks that added output (parsed or matched), counted once per fold_all()
        self._template: ChunkTemplate | None = None
        self._learns = 0
        self._parsed = 0
        self._folded = 0

    @property
    def done(self) -> bool:
        """``[DONE]`` arrived."""
        return self._done

    @property
    def errored(self) -> bool:
        """A chunk with a top-level error arrived."""
        return self._error is not None

    @property
    def finished(self) -> bool:
        """The stream is over (``[DONE]`` or an error): further data is ignored."""
        return self._closed

    @property
    def finish_reason(self) -> str | None:
        return self._finish_reason

    def feed_data(self, data: str | bytes) -> Delta | None:
        """Take one SSE event's data field; return the delta to publish, if any."""
        chunk = self._parse(data)
        return None if chunk is _SKIP else self.add_chunk(chunk)

    def fold(self, data: str | bytes) -> bool:
        """Like :meth:`feed_data`, but the delta is held: :meth:`take_delta` returns all
        that was folded since the last take, merged (the publisher's coalescing, done
        here without one ``Delta`` per chunk). Returns whether the chunk added output.
        Raw bytes go through :meth:`fold_all` (templates); a ``str`` is always parsed."""
        if isinstance(data, bytes):
            return self.fold_all((data,)) == 1
        return self._fold_parsed(data)

    def fold_all(self, fields: Iterable[bytes]) -> int:
        """:meth:`fold` each data field (raw bytes, as ``SSEDecoder.feed_data`` returns
        them) in order; return how many added output. A chunk that matches the stream's
        template (worker/template.py) is folded without parsing it."""
        added = 0
        template = self._template  # None once the stream is over
        for data in fields:
            if template is None or (value := template.match(data)) is None:
                added += self._fold_parsed(data)
                template = self._template
            elif template.kind == "text":  # the hot paths, inlined
                self._content.append(value)
                self._held_text.append(value)
                added += 1
            elif template.kind == "args":
                index, add_to_call, add_to_held = template.key
                add_to_call(value)
                add_to_held(value)
                self._last_call = index
                added += 1
            else:
                added += self._fold_matched(template, value, data)
                template = self._template
        self._folded += added
        return added

    def _fold_parsed(self, data: str | bytes) -> bool:
        chunk = self._parse(data)
        if chunk is _SKIP:
            return False
        self._parsed += 1
        fast = self._fast_fold(chunk)
        if fast is not None:
            kind, value = fast
            if kind == "text":
                self._held_text.append(value)
            else:
                self._hold_fast(kind, value)
            self._learn(data, chunk, kind, value)
            return True
        delta = self.add_chunk(chunk)
        if delta is None:
            return False
        self._flush_fast()
        if delta.content:
            self._held_text.append(delta.content)
            delta.content = ""
        self._held.append(delta)
        return True

    def _fold_matched(self, template: ChunkTemplate, value: str, data: bytes) -> bool:
        """Fold a reasoning value of a chunk that matched the template, as _fast_fold
        would have; if the entry it continues is no longer the last one, the template is
        dropped and the chunk parsed."""
        entry, fragment = template.key
        if self._reasoning[-1] is not entry:
            self._template = None
            return self._fold_parsed(data)
        entry["text"].append(value)
        held = self._held_reasoning
        if held is not None and held[0] is fragment:
            held[1].append(value)
        else:
            self._hold_fast("reasoning", (fragment, value))
        return True

    def _learn(self, data: str | bytes, chunk: Any, kind: str, value: Any) -> None:
        """Learn the template of a fast chunk given as bytes. An attempt costs several
        parses, so attempts are rationed: 8, then one per 16 chunks that templates
        folded and one per 256 parsed chunks. A stream whose chunks never repeat pays a
        few percent for them."""
        folded = value if kind == "text" else value[1]
        if type(data) is not bytes or not is_clean(folded):
            return
        matched = self._folded - self._parsed  # about: parsed chunks may add nothing
        if self._learns >= 8 + max(matched, 0) // 16 + self._parsed // 256:
            self._template = None  # it missed this chunk: stop trying it until a new one
            return
        self._learns += 1
        key: Any = None
        if kind == "args":
            index = value[0]
            key = (index, self._calls[index].args.append, self._held_args[index].append)
        elif kind == "reasoning":
            key = (self._reasoning[-1], value[0])
        template = learn(data, chunk, _TEMPLATE_VALUE[kind], _TEMPLATE_IGNORED, kind, key)
        if template is not None:
            self._template = template

    def _hold_fast(self, kind: str, value: Any) -> None:
        if kind == "args":
            index, args = value
            self._held_args.setdefault(index, []).append(args)
        elif self._held_reasoning is None:
            fragment, text = value
            self._held_reasoning = (fragment, [text])
        else:  # held fragments are shared (a template's), never changed in place
            fragment, text = value
            held, texts = self._held_reasoning
            texts.append(text)
            if fragment is not held:
                self._held_reasoning = ({**held, **fragment}, texts)

    def _flush_fast(self) -> None:
        """Held fast fragments become a delta, before a general one (order is kept)."""
        delta = self._fast_delta()
        if delta is not None:
            self._held.append(delta)

    def _fast_delta(self) -> Delta | None:
        """The held tool-argument and reasoning fragments as a delta, no longer held."""
        calls: list[dict[str, Any]] = []
        for index, parts in self._held_args.items():
            if parts:
                calls.append({"index": index, "function": {"arguments": "".join(parts)}})
                parts.clear()
        reasoning = self._held_reasoning
        if reasoning is None:
            return Delta(None, "", [], calls) if calls else None
        self._held_reasoning = None
        return Delta(None, "", [{**reasoning[0], "text": "".join(reasoning[1])}], calls)

    def take_delta(self) -> Delta | None:
        """Everything :meth:`fold` took in since the last call, as one delta (or None)."""
        held = self._held
        delta: Delta | None = None
        if held:
            self._flush_fast()
            delta = held[0] if len(held) == 1 else merge_all(held)
            self._held = []
        elif self._held_args or self._held_reasoning is not None:
            delta = self._fast_delta()  # (held_args may hold only emptied lists)
        if self._held_text:
            text = "".join(self._held_text)
            self._held_text = []
            if delta is None:
                return Delta(None, text, [], [])  # explicit lists: no default factories
            delta.content = text
        return delta

    def _close(self) -> None:
        """[DONE] or an error: everything after it is ignored, templates included."""
        self._closed = True
        self._template = None

    def _parse(self, data: str | bytes) -> Any:
        """The decoded chunk, or _SKIP for ``[DONE]``, blank data and data after the end."""
        if self._closed:
            return _SKIP
        if data in (DONE, _DONE_BYTES):
            self._done = True
            self._close()
            return _SKIP
        try:
            return from_json(data)
        except (ValueError, RecursionError, TypeError) as exc:  # TypeError: a lone surrogate
            return self._parse_invalid(data, exc)

    def _parse_invalid(self, data: str | bytes, exc: Exception) -> Any:
        if isinstance(data, bytes):
            text = data.decode("utf-8", "replace")
            if text.encode() != data:  # invalid UTF-8 becomes U+FFFD, as in SSE events
                return self._parse(text)
        if not data.strip():
            return _SKIP
        raise ProtocolError(f"invalid JSON in SSE data: {snippet(data)}") from exc

    def add_chunk(self, chunk: dict[str, Any]) -> Delta | None:
        """Fold one decoded chunk; return the delta to publish, if any."""
        if self._closed:
            return None
        delta = self._fast_path(chunk)
        if delta is not None:
            return delta
        if not isinstance(chunk, dict):
            raise _bad("a chunk must be a JSON object", chunk)
        if self._completion_id is None or self._model is None:
            self._take_ids(chunk)
        choices = chunk.get("choices")
        delta = self._add_choices(choices) if choices is not None else None
        self._take_trailer(chunk)
        return delta

    def _fast_path(self, chunk: Any) -> Delta | None:
        """:meth:`_fast_fold` as a delta."""
        fast = self._fast_fold(chunk)
        if fast is None:
            return None
        kind, value = fast
        if kind == "text":
            return Delta(None, value)
        if kind == "args":
            index, args = value
            return Delta(None, "", [], [{"index": index, "function": {"arguments": args}}])
        fragment, text = value
        return Delta(None, "", [{**fragment, "text": text}])

    def _fast_fold(self, chunk: Any) -> tuple[str, Any] | None:
        """The common chunk in a few checks: one choice whose delta is only a text,
        tool-arguments or same-kind reasoning fragment, and nothing else to take. Folds it
        and returns ("text", str), ("args", (index, str)) or ("reasoning", (fragment,
        text)), the fragment without its text;
        None whenever the general path must decide (same result, only slower)."""
        if self._model is None or self._completion_id is None:
            return None
        delta = _single_plain_delta(chunk)
        if delta is None:
            return None
        content = delta.get("content")
        if len(delta) == 1:
            if type(content) is str and content:
                self._content.append(content)
                return "text", content
            tools = delta.get("tool_calls")
            if type(tools) is list and len(tools) == 1:
                return self._fast_arguments(tools[0])
        details = delta.get("reasoning_details")
        if (
            type(details) is list
            and len(details) == 1
            and content in (None, "")
            and delta.get("role") is None
            and delta.keys() <= _REASONING_DELTA_KEYS
        ):
            return self._fast_reasoning(details[0])
        return None

    def _fast_arguments(self, frag: Any) -> tuple[str, Any] | None:
        """``{"index": i, "function": {"arguments": "..."}}`` for a call already open."""
        if type(frag) is not dict or len(frag) != 2:
            return None
        index, fn = frag.get("index"), frag.get("function")
        call = self._calls.get(index) if type(index) is int else None
        if call is None or type(fn) is not dict or fn.keys() != _ARGS_ONLY:
            return None
        args = fn["arguments"]
        if type(args) is not str or not args:
            return None
        call.args.append(args)
        self._last_call = index
        return "args", (index, args)

    def _fast_reasoning(self, frag: Any) -> tuple[str, Any] | None:
        """A text fragment continuing the last entry, its other keys equal to the entry's."""
        entries = self._reasoning
        if type(frag) is not dict or not entries:
            return None
        entry, text = entries[-1], frag.get("text")
        if type(text) is not str or not text or "text" not in entry:
            return None
        kind = entry.get("type")
        if kind == ENCRYPTED or frag.get("type") != kind:
            return None
        out: dict[str, Any] = {}
        for key, value in frag.items():
            if value is not None and key != "text":
                if entry.get(key) != value:
                    return None
                out[key] = value
        if "index" not in out and entry.get("index") is not None:
            out["index"] = entry["index"]
        entry["text"].append(text)
        return "reasoning", (out, text)

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
        for key in _EXTRA_KEYS:
            value = chunk.get(key)
            if value is not None:
                self._extras[key] = value
        error = chunk.get("error")
        if error:
            self._error = error if isinstance(error, dict) else {"message": str(error)}
            self._close()

    def _add_choices(self, choices: Any) -> Delta | None:
        if not isinstance(choices, list):
            raise _bad("choices must be a list", choices)
        for choice in choices:
            if not isinstance(choice, dict):
                raise _bad("a choice must be an object", choice)
            if choice.get("index", 0) == 0:
                return self._add_choice(choice)
        return None

    def _add_choice(self, choice: dict[str, Any]) -> Delta | None:
        reason = choice.get("finish_reason")
        if reason is not None and _str_or_none(reason, "finish_reason"):
            self._finish_reason = reason
        delta = choice.get("delta")
        if delta is None:
            return None
        if not isinstance(delta, dict):
            raise _bad("choices[0].delta must be an object", delta)
        return self._add_delta(delta) if delta else None

    def _add_delta(self, delta: dict[str, Any]) -> Delta | None:
        role = delta.get("role")
        if role is not None:
            role = self._take_role(role)
        content = delta.get("content")
        if content:
            if not isinstance(content, str):
                raise _bad("delta.content must be a string", content)
            self._content.append(content)
        elif content is not None and not isinstance(content, str):
            raise _bad("delta.content must be a string", content)
        reasoning = (
            self._add_reasoning(delta)
            if "reasoning_details" in delta or "reasoning" in delta or "reasoning_content" in delta
            else []
        )
        tools = delta.get("tool_calls")
        calls = self._add_tool_calls(tools) if tools else []
        if role is None and not content and not reasoning and not calls:
            return None
        return Delta(role, content or "", reasoning, calls)

    def _take_role(self, role: Any) -> str | None:
        value = _str_or_none(role, "delta.role")
        if value and self._role is None:
            self._role = value
            return value
        return None

    # reasoning

    def _add_reasoning(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        frags = [self._absorb_reasoning(_clean_reasoning(r)) for r in _reasoning_fragments(delta)]
        return _merge_all_reasoning(frag for frag in frags if frag is not None)

    def _absorb_reasoning(self, frag: dict[str, Any]) -> dict[str, Any] | None:
        """Fold one cleaned fragment into the state; return it (as published) or None."""
        entries = self._reasoning
        if entries and _joins(entries[-1], frag):
            entry = entries[-1]
            if "index" not in frag and entry.get("index") is not None:
                frag["index"] = entry["index"]
            changed = False
        else:
            entry = {}
            entries.append(entry)
            changed = True
        for key, value in frag.items():
            if key in _CONCAT_KEYS:
                parts = entry.get(key)
                if parts is None:
                    entry[key] = [value]
                    changed = True
                elif value:
                    parts.append(value)
                    changed = True
            elif key not in entry:
                entry[key] = value
                changed = True
        return frag if changed else None

    # tool calls

    def _add_tool_calls(self, tools: Any) -> list[dict[str, Any]]:
        if not isinstance(tools, list):
            raise _bad("delta.tool_calls must be a list", tools)
        frags = [self._absorb_tool(raw) for raw in tools]
        return _merge_all_tools(frag for frag in frags if frag is not None)

    def _absorb_tool(self, raw: Any) -> dict[str, Any] | None:
        if not isinstance(raw, dict):
            raise _bad("a tool_calls entry must be an object", raw)
        fn = raw.get("function")
        if fn is None:
            fn = {}
        elif not isinstance(fn, dict):
            raise _bad("tool call function must be an object", fn)
        cid = _str_or_none(raw.get("id"), "tool call id")
        kind = _str_or_none(raw.get("type"), "tool call type")
        name = _str_or_none(fn.get("name"), "tool call function.name")
        args = _arguments(fn.get("arguments"))
        index = self._resolve_index(raw.get("index"), cid)
        call = self._calls.get(index)
        if call is None:
            if not (cid or kind or name or args):
                return None
            call = self._calls[index] = _Call()
        self._last_call = index
        return self._fill_call(call, index, cid, kind, name, args)

    def _fill_call(
        self,
        call: _Call,
        index: int,
        cid: str | None,
        kind: str | None,
        name: str | None,
        args: str,
    ) -> dict[str, Any] | None:
        out: dict[str, Any] = {"index": index}
        if cid and not call.id:
            call.id = out["id"] = cid
            self._ids.setdefault(cid, index)
        if kind and not call.type:
            call.type = out["type"] = kind
        fn: dict[str, str] = {}
        if name and not call.name:
            call.name = fn["name"] = name
        if args:
            call.args.append(args)
            fn["arguments"] = args
        if fn:
            out["function"] = fn
        return out if len(out) > 1 else None

    def _resolve_index(self, index: Any, cid: str | None) -> int:
        if index is not None:
            if type(index) is not int or index < 0:
                raise _bad("tool call index must be a non-negative integer", index)
            return index
        if cid and cid in self._ids:
            return self._ids[cid]
        last = self._last_call
        if last is None:
            return 0
        if cid and self._calls[last].id:
            return max(self._calls) + 1
        return last

    # result

    def finish(self) -> FinalMessage:
        """The final message so far (may be called at any time, any number of times)."""
        error = self._error
        if error is None and self._finish_reason == "error":
            error = {"message": "the upstream ended the stream with finish_reason 'error'"}
        end: End
        if error is not None:
            end = "error"
        elif self._done:
            end = "done"
        else:
            end = "complete" if self._finish_reason else "truncated"
        return FinalMessage(
            role=self._role or "assistant",
            content="".join(self._content),
            reasoning=[_final_entry(entry) for entry in self._reasoning],
            tool_calls=[self._calls[i].final() for i in sorted(self._calls)],
            finish_reason=self._finish_reason,
            usage=self._usage,
            error=error,
            completion_id=self._completion_id,
            model=self._model,
            extras=dict(self._extras),
            end=end,
        )


def _final_entry(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: "".join(v) if k in _CONCAT_KEYS else v for k, v in entry.items()}
