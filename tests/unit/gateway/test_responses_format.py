"""A job's events stream as Responses API events (pure): every event checked against the
SDK's own types (``openai.types.responses``) and accumulated by the SDK's
``ResponseStreamState``; the numbering a function of the entries alone; resets, failures
and cancellations as decided (docs/decisions.md); hostile entries never break the fold."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.gateway_env import parse_frames
from tests.helpers.responses import as_sdk_response, check_stream, plain, sdk_accumulated
from worker.gateway.hub import Row
from worker.gateway.responses_format import (
    ResponseContext,
    ResponseEvents,
    job_id_of,
    response_id,
    responses_usage,
    sse_frames,
)
from worker.gateway.responses_request import translate

ECHO = translate({"model": "some/model", "input": "hi", "metadata": {"k": "v"}}).echo
CTX = ResponseContext("job-1", 1751299200, ECHO)
USAGE = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "lookup"}}


def row(kind: str, data: Any, n: int = 0) -> Row:
    return f"1751299201{n:03d}-0", {"type": kind, "attempt": "1", "data": json.dumps(data)}


def rows(*entries: tuple[str, Any]) -> list[Row]:
    return [row(kind, data, n) for n, (kind, data) in enumerate(entries)]


def fold(entries: list[Row], ctx: ResponseContext = CTX) -> tuple[ResponseEvents, list[Any]]:
    events = ResponseEvents(ctx)
    out = events.opening()
    for entry_id, fields in entries:
        out += events.feed(entry_id, fields)
    return events, out


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


TEXT = rows(
    ("delta", {"role": "assistant", "content": "Hel"}),
    ("delta", {"content": "lo"}),
    ("done", {"finish_reason": "stop", "usage": USAGE}),
)


def test_a_text_reply_is_the_apis_event_sequence() -> None:
    state, events = fold(TEXT)
    assert types(events) == [
        "created", "in_progress", "output_item.added", "content_part.added",
        "output_text.delta", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done", "completed",
    ]  # fmt: skip
    parsed = check_stream(events)
    final = sdk_accumulated(parsed)
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens == 3 and final.usage.output_tokens == 4
    assert final.usage.total_tokens == 7 and final.usage.output_tokens_details.reasoning_tokens == 0
    assert final.completed_at == 1751299201
    assert plain(final) == plain(as_sdk_response(state.response()))
    assert events[-1]["response"] == state.response()  # GET answers what the stream ended with
    assert parsed[0].response.metadata == {"k": "v"} and parsed[0].response.id == "resp_job-1"
    assert [e.delta for e in parsed if e.type == "response.output_text.delta"] == ["Hel", "lo"]


def test_reasoning_refusal_text_and_calls_are_items_in_the_order_they_came() -> None:
    entries = rows(
        ("delta", {"reasoning_details": [
            {"type": "reasoning.text", "text": "Think ", "index": 0},
            {"type": "reasoning.summary", "summary": "Sum", "index": 0},
            {"type": "reasoning.text", "text": "more.", "signature": "sig", "index": 0},
            {"type": "reasoning.encrypted", "data": "ENC", "index": 1},
        ]}),
        ("delta", {"refusal": "No, ", "content": "but "}),
        ("delta", {"content": "here.", "tool_calls": [CALL]}),
        ("delta", {"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "other"}},
                                  {"index": 0, "function": {"arguments": '{"q":'}}]}),
        ("delta", {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}},
                                  {"index": 0, "function": {"arguments": "1}"}}]}),
        ("delta", {"content": "Then more."}),
        ("done", {"finish_reason": "tool_calls", "usage": None}),
    )  # fmt: skip
    _, events = fold(entries)
    final = sdk_accumulated(check_stream(events))
    reasoning, message, first, second, after = final.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == "ENC"
    assert [c.text for c in reasoning.content] == ["Think more."]
    assert [s.text for s in reasoning.summary] == ["Sum"]
    # within one entry content is taken before the refusal; a new kind is a new part
    assert [(p.type, getattr(p, "text", None) or p.refusal) for p in message.content] == [
        ("output_text", "but "), ("refusal", "No, "), ("output_text", "here.")
    ]  # fmt: skip
    assert (first.call_id, first.name, first.arguments) == ("call_1", "lookup", '{"q":1}')
    assert (second.call_id, second.name, second.arguments) == ("call_2", "other", "{}")
    assert after.type == "message" and final.output_text.endswith("Then more.")
    assert final.usage is None
    # the calls stay open until the end (providers may interleave them): done last
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"q":1}', "{}"]
    deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    assert deltas == ['{"q":', "{}", "1}"]
    # each call's item is added with the name its first fragment carried
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["call_id"], i["name"]) for i in added if i["type"] == "function_call"] == [
        ("call_1", "lookup"), ("call_2", "other")
    ]  # fmt: skip


def test_a_call_without_an_id_gets_one_that_stays_the_same() -> None:
    _, events = fold(rows(("delta", {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}),
                          ("done", {"finish_reason": "tool_calls"})))  # fmt: skip
    [call] = sdk_accumulated(check_stream(events)).output
    assert call.call_id == "call_fc_job-1_0"


@pytest.mark.parametrize(
    ("finish", "reason"), [("length", "max_output_tokens"), ("content_filter", "content_filter")]
)
def test_a_cut_reply_is_incomplete_with_its_reason(finish: str, reason: str) -> None:
    _, events = fold([*TEXT[:2], row("done", {"finish_reason": finish}, 9)])
    parsed = check_stream(events)
    assert parsed[-1].type == "response.incomplete"
    response = parsed[-1].response
    assert response.status == "incomplete" and response.incomplete_details.reason == reason
    assert response.output[0].status == "incomplete" and response.output_text == "Hello"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"code": "upstream_stream_error", "message": "boom", "status": 502}, "server_error"),
        ({"code": "upstream_retryable", "message": "busy", "status": 429}, "rate_limit_exceeded"),
        ({"code": "upstream_terminal", "message": "bad", "status": 400}, "invalid_prompt"),
        ({"code": "invalid_job", "message": "bad"}, "invalid_prompt"),
        ({"code": "attempts_exhausted", "message": "died"}, "server_error"),
        ("not an object", "server_error"),
    ],
)
def test_a_failure_is_response_failed_with_a_code_from_the_apis_list(error: Any, code: str) -> None:
    state, events = fold([TEXT[0], row("error", {"error": error, "usage": USAGE}, 5)])
    parsed = check_stream(events)  # no chat-style top-level error, which the SDK raises on
    assert [e.type for e in parsed[-3:]] == [
        "response.content_part.done", "response.output_item.done", "response.failed"
    ]  # fmt: skip
    response = parsed[-1].response
    assert response.status == "failed" and response.error.code == code
    original = error.get("code") if isinstance(error, dict) else "error"
    assert response.error.model_extra == {"chatstream": {"code": original}}
    assert response.output[0].status == "incomplete" and response.output_text == "Hel"
    assert state.failure == (error if isinstance(error, dict) else {})


def test_a_cancelled_job_ends_incomplete_with_status_cancelled() -> None:
    _, events = fold([TEXT[0], row("cancelled", {"usage": None}, 5)])
    parsed = check_stream(events)
    assert parsed[-1].type == "response.incomplete"
    assert parsed[-1].response.status == "cancelled"
    assert parsed[-1].response.incomplete_details is None


def test_a_job_cancelled_while_queued_is_the_lifecycle_only() -> None:
    _, events = fold(rows(("cancelled", {})))
    assert types(events) == ["created", "in_progress", "incomplete"]
    check_stream(events)


def test_a_reset_ends_the_void_items_and_the_next_attempt_continues_the_indexes() -> None:
    entries = rows(
        ("delta", {"content": "first try", "tool_calls": [CALL]}),
        ("reset", {"reason": "attempt 2 starts; earlier deltas are void"}),
        ("delta", {"content": "second"}),
        ("done", {"finish_reason": "stop", "usage": USAGE}),
    )
    state, events = fold(entries)
    parsed = check_stream(events)
    [reset] = [e for e in parsed if e.type == "response.in_progress"][1:]
    reason = {"reason": "attempt 2 starts; earlier deltas are void"}
    assert reset.model_extra == {"chatstream": {"reset": reason}}
    assert reset.response.output == []
    # the text had ended when the call began; the call was still open: it ends incomplete
    void = [e.item for e in parsed if e.type == "response.output_item.done"][:2]
    assert [(item.type, item.status) for item in void] == [
        ("message", "completed"), ("function_call", "incomplete")
    ]  # fmt: skip
    final = sdk_accumulated(parsed)
    assert final.output_text == "second" and len(final.output) == 1
    assert [e.output_index for e in parsed if e.type == "response.output_item.added"] == [0, 1, 2]
    assert state.response()["output"][0]["id"] == "msg_job-1_2"


WAITING = {"reason": "upstream_down", "upstream": "default", "since_ms": 1, "for_s": 0.0}


def test_waiting_entries_add_no_event_and_move_no_number() -> None:
    """The fold skips them: the same events, numbered the same, with or without them."""
    with_waits = [row("waiting", WAITING, 90), TEXT[0], row("waiting", WAITING, 91), *TEXT[1:]]
    assert fold(with_waits)[1] == fold(TEXT)[1]


def test_nothing_follows_the_terminal_entry() -> None:
    state, events = fold([*TEXT, row("delta", {"content": "late"}, 7), row("done", {}, 8)])
    assert types(events)[-1] == "completed" and state.ended


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "delta", "data": "not json"},
        {"type": "delta", "data": "[1, 2]"},
        {"type": "delta"},
        {"type": "delta", "data": json.dumps({"content": 5, "refusal": ["x"], "role": 1})},
        {"type": "delta", "data": json.dumps({"tool_calls": [{"index": "0"}, 5, {"index": True}]})},
        {"type": "delta", "data": json.dumps({"tool_calls": {"index": 0}})},
        {"type": "delta", "data": json.dumps({"reasoning_details": [
            {"type": ["x"]}, {"type": "reasoning.text", "text": 5}, {"type": "reasoning.text"},
            {"type": "reasoning.encrypted", "data": None}, "text"]})},
        {"type": "delta", "data": json.dumps({"tool_calls": [{"index": 0, "function": "f"}]})},
        {"type": "unknown", "data": "{}"},
        {"data": "{}"},
        {"type": "done", "data": json.dumps({"finish_reason": ["stop"], "usage": [1]})},
        {"type": "done", "data": json.dumps({"usage": {"prompt_tokens": "3", "total_tokens": -1,
                                                       "prompt_tokens_details": 5}})},
        {"type": "error", "data": json.dumps({"error": {"code": ["x"], "status": {}}})},
        {"type": "reset", "data": "null"},
    ],
)  # fmt: skip
def test_a_malformed_entry_never_breaks_the_fold(fields: dict[str, str]) -> None:
    state, events = fold([("1751299201000-0", fields), *TEXT])
    check_stream(events)
    as_sdk_response(state.response())


def test_usage_gets_the_apis_details_objects() -> None:
    usage = {
        "prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 2},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }  # fmt: skip
    assert responses_usage(usage) == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 2},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 15,
    }
    assert responses_usage({"prompt_tokens": 2, "completion_tokens": 1})["total_tokens"] == 3  # type: ignore[index]
    assert responses_usage(None) is None


def test_response_ids_name_their_job() -> None:
    assert job_id_of(response_id("abc-1")) == "abc-1"
    for other in ("abc", "resp_", "msg_abc", ""):
        assert job_id_of(other) is None


def test_the_sse_frames_carry_the_type_and_skip_what_was_already_sent() -> None:
    _, events = fold(TEXT)
    parsed = parse_frames(sse_frames(events, after=4))
    assert [e.event for e in parsed] == [e["type"] for e in events[5:]]
    assert [json.loads(e.data) for e in parsed] == events[5:]
    assert sse_frames(events, after=len(events)) == b""


# -- any stream ---------------------------------------------------------------------------------

TEXTS = st.text(alphabet="ab ✓", max_size=3)
DELTAS = st.fixed_dictionaries(
    {},
    optional={
        "role": st.just("assistant"),
        "content": TEXTS,
        "refusal": TEXTS,
        "reasoning_details": st.lists(
            st.one_of(
                st.builds(lambda t: {"type": "reasoning.text", "text": t}, TEXTS),
                st.builds(lambda t: {"type": "reasoning.summary", "summary": t}, TEXTS),
                st.builds(lambda t: {"type": "reasoning.encrypted", "data": t}, TEXTS),
            ),
            max_size=2,
        ),
        "tool_calls": st.lists(
            st.builds(
                lambda i, name, args: {"index": i, "function": {"name": name, "arguments": args}},
                st.integers(0, 2), st.sampled_from(["", "f"]), st.sampled_from(["", "{", "}"]),
            ),
            max_size=2,
        ),
    },
)  # fmt: skip
ENTRIES = st.lists(
    st.one_of(
        st.tuples(st.just("delta"), DELTAS),
        st.tuples(st.just("reset"), st.just({"reason": "attempt 2 starts"})),
        st.tuples(st.just("waiting"), st.just(WAITING)),
    ),
    max_size=12,
)
ENDS = st.sampled_from(
    [
        None,
        ("done", {"finish_reason": "stop", "usage": USAGE}),
        ("done", {"finish_reason": "length"}),
        ("error", {"error": {"code": "upstream_stream_error", "message": "x"}}),
        ("cancelled", {}),
    ]
)


@settings(max_examples=400, deadline=None)
@given(ENTRIES, ENDS, st.integers(0, 60))
def test_any_stream_is_well_formed_for_the_sdk_and_resumes_anywhere(
    entries: list[tuple[str, Any]], end: tuple[str, Any] | None, cut: int
) -> None:
    stream = rows(*entries, *([end] if end else []))
    state, events = fold(stream)
    parsed = check_stream(events)
    final = sdk_accumulated(parsed)
    if end is not None and end[0] == "done" and end[1]["finish_reason"] == "stop":
        assert plain(final) == plain(as_sdk_response(state.response()))
    else:
        assert final is None
    as_sdk_response(state.response())
    # the numbering depends on the entries alone: a second fold (another process, a client
    # resuming) gives the same events, so starting after ``cut`` has no gap and no duplicate
    _, again = fold(stream)
    assert again == events
    resumed = parse_frames(sse_frames(again, after=cut))
    assert [json.loads(e.data) for e in resumed] == events[cut + 1 :]
