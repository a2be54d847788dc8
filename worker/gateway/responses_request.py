"""A Responses API request (``POST /v1/responses``) as a chat-completions job. Pure.

``translate(body)`` returns the job's chat-completions body, the request as every Response
object repeats it (``echo``) and how it is delivered (``stream``, ``background``); a request
the gateway cannot serve raises ``RequestRefused`` (answered with a 400 naming the field).

===================== ====================================================================
``model``             ``model``
``input``             ``messages``: a string is one user message; ``message`` items keep
                      their role (``developer`` becomes ``system``) and content parts
                      (``input_text`` / ``output_text`` as text, ``input_image`` as
                      ``image_url``, ``input_file`` as ``file``, ``input_audio``); a
                      ``refusal`` part is the assistant message's ``refusal``;
                      ``function_call`` items are the assistant message's ``tool_calls``;
                      ``function_call_output`` a ``tool`` message; ``reasoning`` items are
                      left out (a chat request has no place for them)
``instructions``      a ``system`` message before the input
``tools``             function tools as chat ``tools``; any other tool type is refused
``tool_choice``       ``none`` / ``auto`` / ``required``, or one function by name
``max_output_tokens`` ``max_tokens``
``text.format``       ``response_format`` (``json_object``, ``json_schema``); ``text``: none
``text.verbosity``    ``verbosity``
``reasoning.effort``  ``reasoning_effort`` (``summary`` is accepted and not sent)
``temperature``, ``top_p``, ``parallel_tool_calls``, ``user``, ``safety_identifier``,
``prompt_cache_key``, ``service_tier``: sent as they are
``metadata``          kept with the job and repeated in the response (never sent upstream)
``stream``,           how the answer is delivered; ``store``, ``truncation``, ``include``
``background``        (``reasoning.encrypted_content`` only) and ``stream_options`` are
                      accepted and not sent
===================== ====================================================================

Fields the gateway cannot honour (``previous_response_id``, ``conversation``, ``prompt``,
...) are refused; so are chat-completions fields that have a Responses form (``messages``,
``max_tokens``, ``response_format``, ...). Any other field passes through to the upstream
unchanged, as it does on the chat endpoint (provider options, the mock upstream's
``mock``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class RequestRefused(Exception):
    """The request cannot be served; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class ResponsesRequest:
    """A translated request: the job's chat body, the echo, how it is delivered."""

    chat: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    background: bool = False
    instructions: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


# What a Response object says about a request that did not set the field.
ECHO_DEFAULTS: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": None,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_p": None,
    "truncation": "disabled",
}
# Responses fields a chat-completions upstream (or this gateway) cannot honour.
UNSUPPORTED = (
    "previous_response_id",
    "conversation",
    "prompt",
    "max_tool_calls",
    "top_logprobs",
    "context_management",
    "background_options",
    "prompt_cache_retention",
    "prompt_cache_options",
    "moderation",
    "image",
    "access_programs",
)
# chat-completions fields with a Responses form: which one to use instead
CHAT_ONLY = {
    "messages": "input",
    "n": None,
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "functions": "tools",
    "function_call": "tool_choice",
}
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
INCLUDABLE = frozenset({"reasoning.encrypted_content"})


def translate(body: dict[str, Any]) -> ResponsesRequest:
    """The job for a ``POST /v1/responses`` body; RequestRefused when it cannot be one."""
    out = ResponsesRequest(echo=dict(ECHO_DEFAULTS))
    for name in ("model", "input"):
        if body.get(name) is None:
            raise RequestRefused(f"{name} is required", name)
    passed: dict[str, Any] = {}
    for name, value in body.items():
        _refuse_foreign(name, value)
        handler = FIELDS.get(name)
        if name in UNSUPPORTED:
            continue  # null: nothing asked for
        if handler is None:
            passed[name] = value
        elif value is not None:
            handler(value, out)
    out.chat = {
        "model": out.chat.pop("model"),
        "messages": [*out.instructions, *out.messages],
        **out.chat,
        **passed,
    }
    if not out.chat["messages"]:
        raise RequestRefused("input must not be empty", "input")
    out.echo["background"] = out.background
    return out


def request_sha256(body: dict[str, Any]) -> str:
    """The request without how it is delivered (``stream``, ``background``,
    ``stream_options``): what an ``Idempotency-Key`` must find again."""
    same = {k: v for k, v in body.items() if k not in ("stream", "background", "stream_options")}
    canonical = json.dumps(same, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _refuse_foreign(name: str, value: Any) -> None:
    if name in UNSUPPORTED and value is not None:
        raise RequestRefused(f"{name} is not supported by this gateway", name)
    if name in CHAT_ONLY:
        instead = CHAT_ONLY[name]
        hint = f"; use {instead}" if instead else ""
        raise RequestRefused(f"{name} is a chat-completions field, not a Responses one{hint}", name)


# -- checks -----------------------------------------------------------------------------------


def _string(value: Any, param: str, *, blank: bool = True) -> str:
    if not isinstance(value, str) or (not blank and not value.strip()):
        raise RequestRefused(f"{param} must be a {'' if blank else 'non-blank '}string", param)
    return value


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestRefused(f"{param} must be an object", param)
    return value


def _list(value: Any, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise RequestRefused(f"{param} must be a list", param)
    return value


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise RequestRefused(f"{param} must be true or false", param)
    return value


def _optional(value: Any, param: str, check: Callable[[Any, str], Any]) -> Any:
    return None if value is None else check(value, param)


# -- fields -----------------------------------------------------------------------------------


def _model(value: Any, out: ResponsesRequest) -> None:
    out.chat["model"] = out.echo["model"] = _string(value, "model", blank=False)


def _instructions(value: Any, out: ResponsesRequest) -> None:
    out.instructions = [{"role": "system", "content": _string(value, "instructions")}]
    out.echo["instructions"] = value


def _input(value: Any, out: ResponsesRequest) -> None:
    if isinstance(value, str):
        out.messages = [{"role": "user", "content": value}]
        return
    for index, raw in enumerate(_list(value, "input")):
        path = f"input[{index}]"
        item = _object(raw, path)
        kind = item.get("type", "message")
        add = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if add is None:
            raise RequestRefused(f"{path}: input items of type {kind!r} are not supported", path)
        add(item, path, out.messages)


def _max_output_tokens(value: Any, out: ResponsesRequest) -> None:
    if type(value) is not int or value < 1:
        raise RequestRefused("max_output_tokens must be a positive integer", "max_output_tokens")
    out.chat["max_tokens"] = out.echo["max_output_tokens"] = value


def _number(name: str, highest: float) -> Callable[[Any, ResponsesRequest], None]:
    def handle(value: Any, out: ResponsesRequest) -> None:
        if type(value) not in (int, float) or not 0 <= value <= highest:
            raise RequestRefused(f"{name} must be a number from 0 to {highest:g}", name)
        out.chat[name] = out.echo[name] = value

    return handle


def _passed(name: str, check: Callable[[Any, str], Any]) -> Callable[[Any, ResponsesRequest], None]:
    """A field sent upstream under its own name (and repeated in the response)."""

    def handle(value: Any, out: ResponsesRequest) -> None:
        out.chat[name] = out.echo[name] = check(value, name)

    return handle


def _delivery(name: str) -> Callable[[Any, ResponsesRequest], None]:
    def handle(value: Any, out: ResponsesRequest) -> None:
        setattr(out, name, _boolean(value, name))

    return handle


def _metadata(value: Any, out: ResponsesRequest) -> None:
    metadata = _object(value, "metadata")
    if len(metadata) > METADATA_KEYS:
        raise RequestRefused(f"metadata may have at most {METADATA_KEYS} keys", "metadata")
    for key, text in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise RequestRefused(f"metadata keys are at most {METADATA_KEY_CHARS} characters")
        if not isinstance(text, str) or len(text) > METADATA_VALUE_CHARS:
            raise RequestRefused(
                f"metadata values are strings of at most {METADATA_VALUE_CHARS} characters",
                f"metadata.{key}",
            )
    out.echo["metadata"] = metadata


def _store(value: Any, out: ResponsesRequest) -> None:
    _boolean(value, "store")  # accepted either way: every response is kept as a job


def _truncation(value: Any, out: ResponsesRequest) -> None:
    if value not in ("auto", "disabled"):
        raise RequestRefused("truncation must be auto or disabled", "truncation")
    out.echo["truncation"] = value


def _include(value: Any, out: ResponsesRequest) -> None:
    for index, name in enumerate(_list(value, "include")):
        if not isinstance(name, str) or name not in INCLUDABLE:
            raise RequestRefused(f"include {name!r} is not supported", f"include[{index}]")


def _stream_options(value: Any, out: ResponsesRequest) -> None:
    _object(value, "stream_options")  # include_obfuscation: the gateway adds none anyway


def _reasoning(value: Any, out: ResponsesRequest) -> None:
    reasoning = _object(value, "reasoning")
    effort = _optional(reasoning.get("effort"), "reasoning.effort", _string)
    if effort is not None:
        out.chat["reasoning_effort"] = effort
    out.echo["reasoning"] = reasoning


def _text(value: Any, out: ResponsesRequest) -> None:
    text = _object(value, "text")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise RequestRefused(f"text.{sorted(unknown)[0]} is not supported", "text")
    if text.get("format") is not None:
        response_format = _text_format(_object(text["format"], "text.format"))
        if response_format is not None:
            out.chat["response_format"] = response_format
    if text.get("verbosity") is not None:
        out.chat["verbosity"] = _string(text["verbosity"], "text.verbosity")
    out.echo["text"] = {**ECHO_DEFAULTS["text"], **text}


def _text_format(spec: dict[str, Any]) -> dict[str, Any] | None:
    kind = spec.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise RequestRefused(f"text.format type {kind!r} is not supported", "text.format.type")
    schema: dict[str, Any] = {
        "name": _string(spec.get("name"), "text.format.name", blank=False),
        "schema": _object(spec.get("schema"), "text.format.schema"),
    }
    checks: tuple[tuple[str, Callable[[Any, str], Any]], ...] = (
        ("strict", _boolean),
        ("description", _string),
    )
    for name, check in checks:
        if spec.get(name) is not None:
            schema[name] = check(spec[name], f"text.format.{name}")
    return {"type": "json_schema", "json_schema": schema}


def _tools(value: Any, out: ResponsesRequest) -> None:
    chat, echo = [], []
    for index, tool in enumerate(_list(value, "tools")):
        function = _function_tool(_object(tool, f"tools[{index}]"), f"tools[{index}]")
        chat.append({"type": "function", "function": function})
        echo.append(
            {"type": "function", "description": None, "parameters": None, "strict": None} | function
        )
    if chat:
        out.chat["tools"] = chat
    out.echo["tools"] = echo


def _function_tool(tool: dict[str, Any], path: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise RequestRefused(
            f"{path}: {kind!r} tools run inside OpenAI's service; a chat-completions upstream "
            "cannot run them (only function tools are supported)",
            f"{path}.type",
        )
    function: dict[str, Any] = {"name": _string(tool.get("name"), f"{path}.name", blank=False)}
    checks: tuple[tuple[str, Callable[[Any, str], Any]], ...] = (
        ("description", _string),
        ("parameters", _object),
        ("strict", _boolean),
    )
    for name, check in checks:
        if tool.get(name) is not None:
            function[name] = check(tool[name], f"{path}.{name}")
    return function


def _tool_choice(value: Any, out: ResponsesRequest) -> None:
    if value in ("none", "auto", "required"):
        out.chat["tool_choice"] = value
    elif isinstance(value, dict) and value.get("type") == "function":
        name = _string(value.get("name"), "tool_choice.name", blank=False)
        out.chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise RequestRefused(
            "tool_choice must be none, auto, required or {type: function, name}", "tool_choice"
        )
    out.echo["tool_choice"] = value


FIELDS: dict[str, Callable[[Any, ResponsesRequest], None]] = {
    "model": _model,
    "input": _input,
    "instructions": _instructions,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "max_output_tokens": _max_output_tokens,
    "temperature": _number("temperature", 2),
    "top_p": _number("top_p", 1),
    "parallel_tool_calls": _passed("parallel_tool_calls", _boolean),
    "user": _passed("user", _string),
    "safety_identifier": _passed("safety_identifier", _string),
    "prompt_cache_key": _passed("prompt_cache_key", _string),
    "service_tier": _passed("service_tier", _string),
    "metadata": _metadata,
    "text": _text,
    "reasoning": _reasoning,
    "stream": _delivery("stream"),
    "background": _delivery("background"),
    "store": _store,
    "truncation": _truncation,
    "include": _include,
    "stream_options": _stream_options,
}


# -- input items ------------------------------------------------------------------------------

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _message_item(item: dict[str, Any], path: str, messages: list[dict[str, Any]]) -> None:
    role = item.get("role")
    role = ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise RequestRefused(f"{path}.role must be user, assistant, system or developer", path)
    content = item.get("content")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    parts, refusal = [], ""
    for index, raw in enumerate(_list(content, f"{path}.content")):
        part_path = f"{path}.content[{index}]"
        part = _object(raw, part_path)
        if part.get("type") == "refusal":
            refusal += _string(part.get("refusal"), f"{part_path}.refusal")
        else:
            parts.append(_content_part(part, part_path))
    message: dict[str, Any] = {"role": role, "content": _joined(parts)}
    if refusal:
        message["refusal"] = refusal
    messages.append(message)


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]] | None:
    """One text part as a plain string (what every chat upstream reads), else the parts."""
    if not parts:
        return None
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


def _content_part(part: dict[str, Any], path: str) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _string(part.get("text"), f"{path}.text")}
    if kind == "input_image":
        return _image_part(part, path)
    if kind == "input_file":
        return _file_part(part, path)
    if kind == "input_audio":
        return {"type": "input_audio", "input_audio": _object(part.get("input_audio"), path)}
    raise RequestRefused(f"{path}: content parts of type {kind!r} are not supported", path)


def _image_part(part: dict[str, Any], path: str) -> dict[str, Any]:
    if part.get("image_url") is None:
        raise RequestRefused(f"{path}: images need image_url (file ids are not supported)", path)
    image = {"url": _string(part["image_url"], f"{path}.image_url")}
    if part.get("detail") is not None:
        image["detail"] = _string(part["detail"], f"{path}.detail")
    return {"type": "image_url", "image_url": image}


def _file_part(part: dict[str, Any], path: str) -> dict[str, Any]:
    if part.get("file_url") is not None:
        raise RequestRefused(f"{path}: file_url is not supported (send file_data)", path)
    names = ("file_data", "file_id", "filename")
    found = {name: _string(part[name], f"{path}.{name}") for name in names if part.get(name)}
    if not found.keys() & {"file_data", "file_id"}:
        raise RequestRefused(f"{path}: a file needs file_data or file_id", path)
    return {"type": "file", "file": found}


def _function_call_item(item: dict[str, Any], path: str, messages: list[dict[str, Any]]) -> None:
    call = {
        "id": _string(item.get("call_id"), f"{path}.call_id", blank=False),
        "type": "function",
        "function": {
            "name": _string(item.get("name"), f"{path}.name", blank=False),
            "arguments": _string(item.get("arguments", ""), f"{path}.arguments"),
        },
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)  # one assistant turn, several calls
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output_item(item: dict[str, Any], path: str, messages: list[dict[str, Any]]) -> None:
    call_id = _string(item.get("call_id"), f"{path}.call_id", blank=False)
    output = item.get("output")
    if isinstance(output, str):
        content: Any = output
    else:
        parts = _list(output, f"{path}.output")
        content = [
            _content_part(_object(part, f"{path}.output[{i}]"), f"{path}.output[{i}]")
            for i, part in enumerate(parts)
        ]
    messages.append({"role": "tool", "tool_call_id": call_id, "content": content})


def _reasoning_item(item: dict[str, Any], path: str, messages: list[dict[str, Any]]) -> None:
    """Left out: a chat request has no place for a previous turn's reasoning."""


INPUT_ITEMS: dict[str, Callable[[dict[str, Any], str, list[dict[str, Any]]], None]] = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_output_item,
    "reasoning": _reasoning_item,
}
