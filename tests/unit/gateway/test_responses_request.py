"""A Responses API request as a chat-completions job (pure): what each field becomes, what
is refused and why, and what every Response object repeats of the request."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.requests import ChatRequest
from tests.helpers.responses import as_sdk_response
from worker.gateway.responses_format import ResponseContext
from worker.gateway.responses_request import (
    ECHO_DEFAULTS,
    RequestRefused,
    request_sha256,
    translate,
)

LOOKUP = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}


def chat(**body: Any) -> dict[str, Any]:
    return translate({"model": "m", "input": "hi", **body}).chat


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    job = translate({"model": "m", "input": "Hello", "instructions": "Be brief."})
    assert job.chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ],
    }
    assert (job.stream, job.background) == (False, False)
    assert job.echo == {**ECHO_DEFAULTS, "model": "m", "instructions": "Be brief.",
                        "background": False}  # fmt: skip


def test_message_items_keep_their_roles_and_parts() -> None:
    image = {"type": "input_image", "image_url": "https://x/cat.png", "detail": "low"}
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, image]},
        {"role": "user", "content": [
            {"type": "input_file", "file_data": "data:application/pdf;base64,AA",
             "filename": "a.pdf"},
            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
        ]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "No.", "annotations": []},
                     {"type": "refusal", "refusal": "I can't."}]},
    ]  # fmt: skip
    assert chat(input=items)["messages"] == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}},
        ]},
        {"role": "user", "content": [
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,AA",
                                      "filename": "a.pdf"}},
            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
        ]},
        {"role": "assistant", "content": "No.", "refusal": "I can't."},
    ]  # fmt: skip


def test_function_calls_and_their_outputs_are_one_assistant_turn_and_tool_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # left out
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c":"P"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"c":"R"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip

    def call(call_id: str, arguments: str) -> dict[str, Any]:
        function = {"name": "weather", "arguments": arguments}
        return {"id": call_id, "type": "function", "function": function}

    assert chat(input=items)["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("c1", '{"c":"P"}'), call("c2", '{"c":"R"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
    ]  # fmt: skip


def test_a_call_after_an_assistant_message_joins_it() -> None:
    items = [
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
    ]
    [message] = chat(input=items)["messages"]
    assert message["content"] == "Let me look." and message["tool_calls"][0]["id"] == "c1"


def test_the_sampling_tools_and_format_fields_map_to_their_chat_names() -> None:
    schema = {"type": "json_schema", "name": "answer", "schema": {"type": "object"},
              "strict": True}  # fmt: skip
    job = translate({
        "model": "m", "input": "hi", "tools": [LOOKUP, {**LOOKUP, "name": "b", "strict": True,
                                                          "description": "B."}],
        "tool_choice": {"type": "function", "name": "lookup"}, "max_output_tokens": 50,
        "temperature": 0.5, "top_p": 1, "parallel_tool_calls": False, "user": "u1",
        "text": {"format": schema, "verbosity": "low"},
        "reasoning": {"effort": "high", "summary": "auto"},
        "metadata": {"team": "a"}, "store": False, "truncation": "auto",
        "include": ["reasoning.encrypted_content"],
        "stream_options": {"include_obfuscation": False},
        "mock": {"tokens": 3}, "seed": 7,
    })  # fmt: skip
    assert job.chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b", "description": "B.",
                                              "parameters": {"type": "object"}, "strict": True}},
        ],
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "max_tokens": 50, "temperature": 0.5, "top_p": 1, "parallel_tool_calls": False,
        "user": "u1",
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": {"type": "object"}, "strict": True}},
        "verbosity": "low", "reasoning_effort": "high",
        "mock": {"tokens": 3}, "seed": 7,  # unknown fields pass through, as on the chat endpoint
    }  # fmt: skip
    echo = job.echo
    assert echo["metadata"] == {"team": "a"} and "metadata" not in job.chat
    assert echo["tools"][0] == {"type": "function", "name": "lookup", "description": None,
                                "parameters": {"type": "object"}, "strict": None}  # fmt: skip
    assert echo["truncation"] == "auto"
    # the echo is a valid Response in the SDK's own types
    response = as_sdk_response(ResponseContext("j", 1, echo).response("queued", []))
    assert response.tool_choice.name == "lookup"  # type: ignore[union-attr]
    assert response.text and response.text.format
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"model": " "}, "model"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": ["message"]}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
        ({"input": [{"role": ["user"], "content": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "u"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
         "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
         "input[0].output"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": [{**LOOKUP, "parameters": "x"}]}, "tools[0].parameters"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": "any"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": True}, "max_output_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": "1"}, "top_p"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"colour": "red"}}, "text"),
        ({"reasoning": {"effort": 3}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"stream": "yes"}, "stream"),
        ({"background": 1}, "background"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"n": 2}, "n"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_refused_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(RequestRefused) as refused:
        translate({"model": "m", "input": "hi", **fields})
    assert refused.value.param == param
    assert refused.value.message


def test_the_refusal_of_a_builtin_tool_says_why() -> None:
    with pytest.raises(RequestRefused, match="only function tools are supported"):
        translate({"model": "m", "input": "hi", "tools": [{"type": "code_interpreter"}]})


def test_unsupported_fields_set_to_null_are_accepted() -> None:
    assert chat(previous_response_id=None, conversation=None, temperature=None) == chat()


def test_the_idempotency_hash_ignores_how_the_reply_is_delivered() -> None:
    body = {"model": "m", "input": "hi"}
    same = request_sha256(body)
    delivered = {**body, "stream": True, "background": True, "stream_options": {}}
    assert request_sha256(delivered) == same
    assert request_sha256({**body, "metadata": {"a": "b"}}) != same


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)  # fmt: skip
FIELD_NAMES = st.sampled_from(
    ["model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
     "reasoning", "metadata", "include", "stream", "temperature", "role", "content", "type"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(FIELD_NAMES, JSON, max_size=6), st.lists(st.dictionaries(FIELD_NAMES, JSON)))
def test_any_json_body_is_a_valid_job_or_a_refusal(body: dict[str, Any], items: Any) -> None:
    for candidate in (body, {"model": "m", **body, "input": items}):
        try:
            job = translate(candidate)
        except RequestRefused as refused:
            assert refused.message
            continue
        ChatRequest.model_validate(job.chat)  # what Gateway.submit requires of it
