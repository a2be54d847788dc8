"""worker.upstream.error_body: an upstream's error body as the error object it carries, and
the key masked in it only where it stands whole."""

from __future__ import annotations

import json

import pytest

from worker.logs import mask_credentials
from worker.upstream.error_body import error_detail

ERROR = {"message": "litellm.ServiceUnavailableError: " + "x" * 300, "type": None, "code": "503"}
SSE = "text/event-stream"


def test_a_json_body_gives_its_error_member_or_itself() -> None:
    assert error_detail(json.dumps({"error": ERROR}), "application/json") == ERROR
    assert error_detail('{"detail": "nope"}', "application/json") == {"detail": "nope"}
    assert error_detail("", "application/json") is None


@pytest.mark.parametrize(
    "body",
    [
        f"data: {json.dumps({'error': ERROR})}\n\n",  # LiteLLM's streaming error
        f"event: error\r\ndata: {json.dumps({'error': ERROR})}\r\n\r\n",
        f": keep-alive\n\ndata: [DONE]\n\ndata: {json.dumps({'error': ERROR})}",  # cut short
    ],
)
def test_an_sse_body_gives_the_error_object_of_its_first_json_event(body: str) -> None:
    """Whole: the message is not cut at 200 characters, nor quoted as a snippet."""
    assert error_detail(body, SSE) == ERROR


def test_an_sse_body_is_told_by_its_shape_too() -> None:
    body = f"data: {json.dumps({'error': ERROR})}\n\n"
    assert error_detail(body, "text/plain; charset=utf-8") == ERROR


def test_a_body_that_is_neither_is_a_short_snippet() -> None:
    assert error_detail("Service Unavailable", "text/html") == "'Service Unavailable'"
    cut = error_detail("data: not json\n\n" + "y" * 500, SSE)
    assert isinstance(cut, str) and cut.startswith("'data: not json") and len(cut) < 220


def test_a_short_key_is_masked_only_where_it_stands_whole() -> None:
    """With a key of ``k``, an upstream's ``mock: HTTP 400`` stays as it is (it used to be
    stored as ``moc[REDACTED]: HTTP 400``); the key alone is still masked."""
    assert mask_credentials("mock: HTTP 400", ["k"], "[REDACTED]") == "mock: HTTP 400"
    echoed = '{"message": "Incorrect API key provided: k"}'
    assert mask_credentials(echoed, ["k"], "[REDACTED]") == (
        '{"message": "Incorrect API key provided: [REDACTED]"}'
    )
    assert mask_credentials("a\\1 sk-x", ["sk-x"], r"[\1]") == r"a\1 [\1]"  # taken literally
