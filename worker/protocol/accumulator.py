"""Fold ``chat.completion.chunk`` data into the final message and the deltas to publish.

Pure and on the hot path: :meth:`Accumulator.fold_all` takes the data fields of one
upstream read as raw bytes (``SSEDecoder.feed_data``), :meth:`Accumulator.take_delta`
returns what they added as one :class:`Delta` to publish, :meth:`Accumulator.finish` the
final message. Chunks are the plain dicts ``pydantic_core.from_json`` returns (``_parse_json``).

The accumulator reads; ``worker/protocol/message.py`` merges. It validates each chunk and routes
its fields to the :class:`~worker.message.Message` of their choice, which holds every
merge rule once. The fast path (a chunk whose only effect is a string appended to choice
0's content, to a call's arguments or to the last reasoning entry, found by a few type
checks) skips validation and routing, never the merge.

Reading chunks (the rules of the upstream side):

* A tool-call fragment without ``index`` joins the call with the same ``id``; else, if it
  carries a new ``id`` while the last call has one, it starts a new call; else it joins
  the last call (the first when there is none). Arguments sent as a JSON object become a
  compact JSON string. A delta without ``reasoning_details`` may carry ``reasoning``
  (OpenRouter) or ``reasoning_content`` (DeepSeek, vLLM) as a plain string: a
  ``reasoning.text`` fragment. ``null`` values never erase anything.
* ``usage``, ``web_search``, ``free_tier``: the last non-null value (never summed);
  ``completion_id`` / ``model``: from the first chunk that has them.
* A chunk with a top-level ``error`` (not ``null``, ``false``, ``""`` or ``{}``) ends the
  stream, its output still folded (a non-object error becomes ``{"message": str(error)}``);
  so does ``[DONE]`` (only as the whole data field). A ``finish_reason`` of ``"error"``
  ends as an error too; an empty ``finish_reason`` never replaces one.
* Lone UTF-16 surrogate escapes, which jiter refuses, are read by ``json.loads``: text
  fragments keep them (a pair split across chunks is joined when the parts are) and
  every other string is made valid at once. A lone half becomes U+FFFD; a trailing first
  half waits, unpublished, until its choice ends.
* Anything structurally wrong (invalid JSON, a chunk that is not an object, a content that
  is not a string, ...) raises :class:`~worker.errors.ProtocolError`, and nothing else
  escapes; what was folded before it can still be taken.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic_core import from_json

from schemas.jobs import EXTRAS
from worker.errors import MidStreamError, ProtocolError, TruncatedStreamError, snippet
from worker.protocol.message import CONCAT, Delta, Message, joins, pair_surrogates

__all__ = ["Accumulator", "Delta", "FinalMessage"]

DONE = b"[DONE]"
End = Literal["done", "complete", "truncated", "error"]


def _parse_json(data: bytes) -> Any:
    """``from_json`` without its string cache: jiter keeps up to 16,384 strings (keys and
    values) in a process-wide cache, and an upstream's values are mostly new (completion ids,
    tokens), so the cache filled with one job's strings after another through a worker's
    first thousands of jobs (about 1 MB; docs/decisions.md, 75) for no measured gain."""
    return from_json(data, cache_strings=False)


def _bad(what: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{what}, got {type(value).__name__}: {snippet(repr(value))}")


@dataclass
class FinalMessage:
    """Choice 0's output (the record's top-level fields), the other choices' (n > 1, each
    :meth:`Message.final` with its ``index``), the stream's trailers and how it ended."""

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
    extras: dict[str, Any]  # the EXTRAS that arrived
    end: End

    def exception(self) -> MidStreamError | TruncatedStreamError | None:
        """The error this outcome stands for: error -> MidStreamError, truncated -> retryable."""
        if self.end == "truncated":
            return TruncatedStreamError("the stream ended with neither [DONE] nor a finish_reason")
        if self.end != "error":
            return None
        error = self.error or {}
        message = error.get("message")
        return MidStreamError(
            message if isinstance(message, str) and message else "upstream mid-stream error",
            status=error_status(error),
            detail=error,
        )


def error_status(error: dict[str, Any]) -> int | None:
    """The HTTP status an error object carries in ``code`` or ``status``, as a number or a
    string of three digits (LiteLLM sends ``"503"``); None for a name
    (``"rate_limit_exceeded"``)."""
    for key in ("code", "status"):
        if (status := _as_status(error.get(key))) is not None:
            return status
    return None


def _as_status(value: Any) -> int | None:
    if isinstance(value, str) and len(value) == 3 and value.isascii() and value.isdigit():
        value = int(value)
    return value if type(value) is int and 100 <= value <= 599 else None


# --- reading chunks -----------------------------------------------------------------------


class _Fast(NamedTuple):
    """What a fast chunk appends to: ``kind`` "text" (choice 0's content), "args" (call
    ``call``) or "reasoning" (``key``, "text" or "summary", of the last reasoning entry)."""

    kind: str
    call: int = 0
    key: str = "text"


_TEXT = _Fast("text")
_SKIP: Any = object()  # _parse(): nothing to fold
_TRAILERS = ("usage", *EXTRAS)
_TEXT_DELTA = frozenset({"content", "role", "refusal"})
_ARGS_DELTA = frozenset({"tool_calls", "content", "role", "refusal"})
_REASONING_DELTA = frozenset({"reasoning_details", "reasoning", "reasoning_content", *_ARGS_DELTA})
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
        return node if texts is True else pair_surrogates(node)
    paths = texts if isinstance(texts, dict) else {}
    if isinstance(node, list):
        return [_valid(item, paths.get("*")) for item in node]
    if isinstance(node, dict):
        return {pair_surrogates(key): _valid(value, paths.get(key)) for key, value in node.items()}
    return node


def _null_trailers(chunk: dict[str, Any]) -> bool:
    """No usage, extra or error (``null`` or absent; an empty error is no error)."""
    for key in _TRAILERS:
        if chunk.get(key) is not None:
            return False
    return not chunk.get("error")


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


def _reasoning_fragments(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """The delta's reasoning fragments, validated, without null values."""
    details = delta.get("reasoning_details")
    if not details:
        text = delta.get("reasoning")
        text = _str_or_none(
            delta.get("reasoning_content") if text is None else text, "delta.reasoning"
        )
        return [{"type": "reasoning.text", "text": text}] if text else []
    if not isinstance(details, list) or not all(isinstance(d, dict) for d in details):
        raise _bad("delta.reasoning_details must be a list of objects", details)
    fragments = [{k: v for k, v in detail.items() if v is not None} for detail in details]
    for fragment in fragments:
        for key in ("type", *CONCAT):
            _str_or_none(fragment.get(key), f"reasoning_details {key}")
    return fragments


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
        self._fed = False  # data arrived since the last take_delta

    @property
    def closed(self) -> bool:
        """``[DONE]`` or an error chunk arrived: the stream is over."""
        return self._closed

    @property
    def truncated(self) -> bool:
        """Neither closed nor a finish_reason for every choice (yet)."""
        message = self._message
        choices = (message, *message.choices.values())
        return not self._closed and any(choice.finish_reason is None for choice in choices)

    def fold_all(self, fields: Iterable[bytes]) -> int:
        """Fold the data fields of one read (raw bytes, as ``SSEDecoder.feed_data`` returns
        them) in order; return how many added output."""
        if not fields:
            return 0
        self._fed = True
        return sum([self._fold_parsed(data) for data in fields])

    def take_delta(self) -> Delta | None:
        """Everything folded since the last call, as one delta to publish (None: nothing)."""
        if not self._fed:
            return None
        self._fed = False
        return self._message.take(self._lenient, self._closed) or None

    def finish(self) -> FinalMessage:
        """The final message so far (may be called at any time, any number of times)."""
        fix, closed, message = self._lenient, self._closed, self._message
        others = [{"index": i, **m.final(fix, closed)} for i, m in sorted(message.choices.items())]
        reasons = [message.finish_reason, *(choice["finish_reason"] for choice in others)]
        error = self._error
        if error is None and "error" in reasons:
            error = {"message": "the upstream ended the stream with finish_reason 'error'"}
        end: End = "error" if error else "done" if self._done else "complete"
        return FinalMessage(
            **message.final(fix, closed),
            choices=others or None,
            usage=self._usage,
            error=error,
            completion_id=self._completion_id,
            model=self._model,
            extras=dict(self._extras),
            end="truncated" if end == "complete" and None in reasons else end,
        )

    def _fold_parsed(self, data: bytes) -> bool:
        if self._closed:
            return False
        chunk = self._parse(data)
        if chunk is _SKIP:
            return False
        fast = self._fast(chunk)
        if fast is None:
            return self._fold_chunk(chunk)
        self._fold_fast(*fast)
        return True

    def _parse(self, data: bytes) -> Any:
        """The decoded chunk, or _SKIP for ``[DONE]`` and blank data."""
        if data == DONE:
            self._done = True
            self._close()
            return _SKIP
        try:
            return _parse_json(data)
        except (ValueError, RecursionError):
            pass
        text = data.decode("utf-8", "replace")  # invalid UTF-8: U+FFFD, as in SSE events
        if not text.strip():
            return _SKIP
        try:
            chunk = json.loads(text)  # lone surrogate escapes, which jiter refuses
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"invalid JSON in SSE data: {snippet(text)}") from exc
        self._lenient = True
        return _valid(chunk, _TEXT_PATHS)

    # the fast path: one string appended

    def _fold_fast(self, fast: _Fast, value: str) -> None:
        """Append ``value`` where ``fast`` says (``_fast`` checked that it may)."""
        message, kind = self._message, fast.kind
        if kind == "args":
            message.add_arguments(fast.call, value)
        elif kind == "text":
            message.content.append(value)
        else:
            message.add_reasoning_text(fast.key, value)

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
        choices = chunk.get("choices")
        if type(choices) is not list or len(choices) != 1 or not _null_trailers(chunk):
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
        if type(value) is not str or not value or key not in entry.texts:
            return None
        if not joins(entry, fragment):
            return None
        for other, known in fragment.items():
            if other != key and known is not None and entry.keys.get(other) != known:
                return None
        return _Fast("reasoning", key=key), value

    # the general path: validate, route to the Message rules

    def _fold_chunk(self, chunk: Any) -> bool:
        if not isinstance(chunk, dict):
            raise _bad("a chunk must be a JSON object", chunk)
        cid, model = chunk.get("id"), chunk.get("model")
        if self._completion_id is None and type(cid) is str and cid:
            self._completion_id = cid
        if self._model is None and type(model) is str and model:
            self._model = model
        choices = chunk.get("choices")
        if choices is None:
            choices = []
        elif not isinstance(choices, list):
            raise _bad("choices must be a list", choices)
        added = any([self._fold_choice(choice) for choice in choices])
        self._take_trailer(chunk)
        return added

    def _take_trailer(self, chunk: dict[str, Any]) -> None:
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise _bad("usage must be an object", usage)
            self._usage = usage
        for key in EXTRAS:
            if chunk.get(key) is not None:
                self._extras[key] = chunk[key]
        error = chunk.get("error")
        if error:
            self._error = error if isinstance(error, dict) else {"message": str(error)}
            self._close()

    def _close(self) -> None:
        """[DONE] or an error: everything after it is ignored."""
        self._closed = True

    def _fold_choice(self, choice: Any) -> bool:
        """Validate a choice's delta into the published form and merge it; whether it had
        output."""
        if not isinstance(choice, dict):
            raise _bad("a choice must be an object", choice)
        index = choice.get("index")
        if index is not None and (type(index) is not int or index < 0):
            raise _bad("a choice index must be a non-negative integer", index)
        message = self._message.choice(index or 0)
        if reason := _str_or_none(choice.get("finish_reason"), "finish_reason"):
            message.finish_reason = reason
        delta = choice.get("delta")
        if delta is None:
            return False
        if not isinstance(delta, dict):
            raise _bad("a choice's delta must be an object", delta)
        clean: dict[str, Any] = {k: v for k in ("role", "content", "refusal")
                                 if (v := _str_or_none(delta.get(k), f"delta.{k}"))}  # fmt: skip
        if fragments := _reasoning_fragments(delta):
            clean["reasoning_details"] = fragments
        message.add(clean)
        tools = delta.get("tool_calls") or []
        if not isinstance(tools, list):
            raise _bad("delta.tool_calls must be a list", tools)
        added = [self._fold_call(message, raw) for raw in tools]
        return len(clean) > ("role" in clean) or any(added)

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
