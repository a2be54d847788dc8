"""One choice's output merged so far: the merge rules, once (docs/events.md, "Merging
deltas").

:class:`Message` is the only code that merges: ``set_role``, ``add`` (a delta in the
published form), ``add_reasoning`` and ``add_call``. The accumulator keeps one per choice
and routes each chunk's validated fields to it; ``Message.take`` renders what changed since
the last take (the delta to publish) and ``Message.final`` the whole (the record).
:class:`Delta`, a published delta, merges with a later one through a fresh ``Message``: the
publisher coalescing deltas and a consumer rebuilding the reply apply the same rules.

Text is kept as parts (:class:`_Parts`), joined once when rendered; a part may hold half of
a UTF-16 surrogate pair (a chunk read leniently, see ``worker/protocol/accumulator.py``), which the
join pairs with its other half or turns into U+FFFD.
"""

from __future__ import annotations

from typing import Any

ENCRYPTED = "reasoning.encrypted"
CONCAT = ("text", "summary")  # the reasoning keys that concatenate


def joins(entry: ReasoningEntry, fragment: dict[str, Any]) -> bool:
    """Whether a reasoning fragment continues ``entry`` rather than starting a new one."""
    keys = entry.keys
    kind = keys.get("type")
    if kind != fragment.get("type") or kind == ENCRYPTED or "signature" in keys:
        return False
    a, b = keys.get("index"), fragment.get("index")
    return a is None or b is None or a == b


class _Parts(list[str]):
    """Text fragments, joined when rendered; ``taken``: how many :meth:`take` rendered.
    With ``fix`` (a chunk had lone surrogates) pairs are joined and lone halves become
    U+FFFD, except a trailing first half: until ``ended`` it waits for its other half."""

    __slots__ = ("taken",)

    def __init__(self, *parts: str) -> None:
        super().__init__(parts)
        self.taken = 0

    def take(self, fix: bool, ended: bool) -> str:
        """The text added since the last take."""
        at = self.taken
        self.taken = size = len(self)
        text = self[at] if size == at + 1 else "".join(self[at:])
        if not fix:
            return text
        if _waits(text, ended):
            last = self.pop()
            self.extend([last[:-1], last[-1]] if len(last) > 1 else [last])
            self.taken = len(self) - 1
            text = text[:-1]
        return pair_surrogates(text)

    def text(self, fix: bool, ended: bool) -> str:
        text = "".join(self)
        return pair_surrogates(text[:-1] if _waits(text, ended) else text) if fix else text


def _waits(text: str, ended: bool) -> bool:
    return not ended and text != "" and "\ud800" <= text[-1] <= "\udbff"


def pair_surrogates(text: str) -> str:
    """Surrogate pairs joined into one character, lone surrogates as U+FFFD."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


class _Call:
    """One tool call merged so far; ``fresh``: its id, type or name were set since the
    last take (and are published again, whole)."""

    __slots__ = ("args", "fresh", "id", "name", "type")

    def __init__(self) -> None:
        self.id = self.type = self.name = ""
        self.args = _Parts()
        self.fresh = False

    def announce(self, index: int, arguments: str) -> dict[str, Any]:
        """The fragment of a ``fresh`` call: its id, type and name, and ``arguments``."""
        self.fresh = False
        fragment: dict[str, Any] = {"index": index}
        if self.id:
            fragment["id"] = self.id
        if self.type:
            fragment["type"] = self.type
        function = {"name": self.name} if self.name else {}
        if arguments:
            function["arguments"] = arguments
        if function:
            fragment["function"] = function
        return fragment

    def final(self, fix: bool, ended: bool) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.args.text(fix, ended)}
        return {"id": self.id, "type": self.type or "function", "function": function}


class ReasoningEntry:
    """One reasoning entry merged so far: ``keys`` keep their first non-null value,
    ``texts`` (the CONCAT keys) concatenate; ``fresh``: a key was added since the last
    take (the entry is published again, whole)."""

    __slots__ = ("fresh", "keys", "texts")

    def __init__(self, fragment: dict[str, Any]) -> None:
        self.keys = {k: v for k, v in fragment.items() if k not in CONCAT}
        self.texts = {k: _Parts(v) for k, v in fragment.items() if k in CONCAT}
        self.fresh = True

    def add(self, fragment: dict[str, Any]) -> None:
        for key, value in fragment.items():
            if key in CONCAT and key in self.texts:
                self.texts[key].append(value)
            elif key in CONCAT:
                self.texts[key], self.fresh = _Parts(value), True
            elif key not in self.keys:
                self.keys[key], self.fresh = value, True

    def take(self, fix: bool, ended: bool) -> dict[str, Any] | None:
        """What the entry added since the last take, with its keys, so that it joins the
        same entry when merged; None: nothing."""
        ended = fix and (ended or "signature" in self.keys)  # a signed entry takes no more
        fragment, fresh = dict(self.keys), self.fresh
        self.fresh = False
        for key, parts in self.texts.items():
            if (fresh or len(parts) > parts.taken) and ((text := parts.take(fix, ended)) or fresh):
                fragment[key] = text
        return fragment if len(fragment) > len(self.keys) or fresh else None

    def final(self, fix: bool, ended: bool) -> dict[str, Any]:
        ended = ended or "signature" in self.keys
        return {**self.keys, **{k: parts.text(fix, ended) for k, parts in self.texts.items()}}


class Message:
    """One choice's output merged so far (choice 0's holds the others in ``choices``)."""

    __slots__ = ("_changed", "_entry_at", "_more", "_role_taken", "_thought", "calls", "choices",
                 "content", "finish_reason", "ids", "last_call", "reasoning", "refusal",
                 "role")  # fmt: skip

    def __init__(self) -> None:
        self.role: str | None = None
        self.content, self.refusal = _Parts(), _Parts()
        self.reasoning: list[ReasoningEntry] = []
        self.calls: dict[int, _Call] = {}
        self.ids: dict[str, int] = {}  # call id -> index
        self.last_call: int | None = None
        self.choices: dict[int, Message] = {}
        self.finish_reason: str | None = None  # not in deltas: the terminal entry has it
        self._role_taken = False
        self._changed: set[int] = set()  # calls merged into since the last take
        self._entry_at = 0  # the last entry at the last take
        self._thought = False  # reasoning merged since the last take
        self._more = False  # role, refusal or other choices merged since the last take

    def choice(self, index: int) -> Message:
        if index == 0:
            return self
        self._more = True
        return self.choices.setdefault(index, Message())

    def set_role(self, role: str) -> None:
        if self.role is None:
            self.role, self._more = role, True

    def add(self, delta: dict[str, Any]) -> None:
        """Merge a delta in the published form (docs/events.md); not validated."""
        if delta.get("role"):
            self.set_role(delta["role"])
        if delta.get("content"):
            self.content.append(delta["content"])
        if delta.get("refusal"):
            self.refusal.append(delta["refusal"])
            self._more = True
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
        if entries and joins(entries[-1], fragment):
            entries[-1].add(fragment)
        else:
            entries.append(ReasoningEntry(fragment))
        self._thought = True

    def add_reasoning_text(self, key: str, text: str) -> None:
        """Append to the last entry's ``key`` (a fragment ``joins`` accepted, adding no
        other key: the fast path's)."""
        self.reasoning[-1].texts[key].append(text)
        self._thought = True

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
        self.add_arguments(index, args or "")
        return True

    def add_arguments(self, index: int, text: str) -> None:
        """Append to the arguments of call ``index`` (it exists)."""
        if text:
            self.calls[index].args.append(text)
        self.last_call = index
        self._changed.add(index)

    def take(self, fix: bool, closed: bool) -> Delta:
        """What was merged since the last take, in the published form (only non-empty
        keys); ``fix`` and ``closed``: see :class:`_Parts`."""
        out = Delta()
        ended = fix and (closed or self.finish_reason is not None)  # (only fix reads it)
        content = self.content
        if content and len(content) > content.taken and (text := content.take(fix, ended)):
            out["content"] = text
        if (self._thought or (fix and self.reasoning)) and (
            fragments := self._take_reasoning(fix, ended)
        ):
            out["reasoning_details"] = fragments
        if self._changed and (calls := self._take_calls(fix, ended)):
            out["tool_calls"] = calls
        if self._more or fix:
            self._take_more(out, fix, closed)
        return out

    def _take_more(self, out: Delta, fix: bool, closed: bool) -> None:
        """The role, the refusal and the other choices (rarer than the rest)."""
        self._more = False
        if self.role is not None and not self._role_taken:
            out["role"], self._role_taken = self.role, True
        refusal = self.refusal
        ended = closed or self.finish_reason is not None
        if len(refusal) > refusal.taken and (text := refusal.take(fix, ended)):
            out["refusal"] = text
        if self.choices:
            others = sorted(self.choices.items())
            if choices := [{"index": i, **d} for i, m in others if (d := m.take(fix, closed))]:
                out["choices"] = choices

    def _take_calls(self, fix: bool, ended: bool) -> list[dict[str, Any]]:
        changed, calls, fragments = self._changed, self.calls, []
        for index in sorted(changed) if len(changed) > 1 else changed:
            call = calls[index]
            args, at = call.args, call.args.taken
            if not fix and len(args) == at + 1:  # _Parts.take's usual case, inline (decision 33)
                args.taken, arguments = at + 1, args[at]
            else:
                arguments = args.take(fix, ended)
            if call.fresh:
                fragments.append(call.announce(index, arguments))
            elif arguments:
                fragments.append({"index": index, "function": {"arguments": arguments}})
        changed.clear()
        if fix:  # a call whose last part waits for its surrogate's other half: take it again
            changed.update(i for i, call in calls.items() if len(call.args) > call.args.taken)
        return fragments

    def _take_reasoning(self, fix: bool, ended: bool) -> list[dict[str, Any]]:
        entries, last, fragments = self.reasoning, len(self.reasoning) - 1, []
        if self._entry_at < last:  # entries closed since the last take
            for entry in entries[self._entry_at : last]:
                if (fragment := entry.take(fix, True)) is not None:
                    fragments.append(fragment)
        self._entry_at, self._thought = last, False
        if (fragment := entries[last].take(fix, ended)) is not None:
            fragments.append(fragment)
        return fragments

    def final(self, fix: bool, closed: bool) -> dict[str, Any]:
        """The whole output: role, content, refusal, reasoning, tool_calls, finish_reason."""
        ended = closed or self.finish_reason is not None
        last = self.reasoning[-1] if self.reasoning else None
        return {
            "role": self.role or "assistant",
            "content": self.content.text(fix, ended),
            "refusal": self.refusal.text(fix, ended),
            "reasoning": [e.final(fix, ended or e is not last) for e in self.reasoning],
            "tool_calls": [self.calls[i].final(fix, ended) for i in sorted(self.calls)],
            "finish_reason": self.finish_reason,
        }


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
