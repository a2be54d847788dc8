"""What a ``chatstream worker`` process keeps of an upstream's errors, on a real Redis: an
error body sent as Server-Sent Events with a 5xx (LiteLLM's streaming errors), a mid-stream
error chunk whose ``code`` is a string, and a short API key that masks only whole
credentials in the record and the log line (docs/failures.md, docs/security.md)."""

from __future__ import annotations

import pytest

from tests.helpers.fleet import Fleet
from tests.helpers.gateway_env import delta, openai_chunk
from tests.helpers.harness import chat

pytestmark = pytest.mark.xdist_group("worker-processes")


async def test_an_sse_error_body_with_a_5xx_is_kept_as_its_error_object(fleet: Fleet) -> None:
    """503, ``content-type: text/event-stream``, ``data: {"error": {...}}``: the record's
    ``detail`` is the error object (it was the body quoted as a string, cut at 200)."""
    await fleet.start(1, retry_attempts=2)
    record = await fleet.client.result(
        await fleet.client.enqueue(chat("hi", fault="sse_503")), timeout=30
    )
    assert record.status == "failed" and record.error is not None
    assert (record.error["code"], record.error["status"]) == ("upstream_retryable", 503)
    assert record.error["detail"] == {"message": "mock: HTTP 503", "type": "server_error",
                                      "code": "503"}  # fmt: skip
    await fleet.stop()


async def test_a_mid_stream_error_whose_code_is_a_string_gives_its_status(fleet: Fleet) -> None:
    error = {"message": "litellm.ServiceUnavailableError: overloaded", "code": "503"}
    script = [
        openai_chunk(delta(0, role="assistant", content="Hel")),
        openai_chunk(delta(0, "error"), error=error),
    ]
    await fleet.start(1)
    record = await fleet.client.result(
        await fleet.client.enqueue(chat("hi", script=script)), timeout=30
    )
    assert record.status == "failed" and record.error is not None
    assert (record.error["code"], record.error["status"]) == ("upstream_stream_error", 503)
    assert (record.content, record.error["detail"]) == ("Hel", error)
    await fleet.stop()


async def test_a_one_letter_key_masks_no_part_of_another_word(fleet: Fleet) -> None:
    """With ``CHATSTREAM_UPSTREAM_API_KEY=k`` the upstream's ``mock: HTTP 400`` is kept as
    it is in the record and in the worker's failure line (the record had
    ``moc[REDACTED]: HTTP 400``)."""
    await fleet.start(1, upstream_api_key="k")
    record = await fleet.client.result(
        await fleet.client.enqueue(chat("hi", fault="http_400")), timeout=30
    )
    assert record.error is not None and record.error["status"] == 400
    assert record.error["detail"]["message"] == "mock: HTTP 400"
    output = await fleet.stop()
    assert 'upstream_message="mock: HTTP 400"' in output, output


async def test_a_key_an_upstream_echoes_in_an_error_chunk_is_masked_in_the_record(
    fleet: Fleet,
) -> None:
    """A hostile upstream puts the API key into an error chunk after its 200: the record and
    the stream keep the error with the key masked, as they keep an error body."""
    key = "sk-live-0123456789abcdef"
    error = {"message": f"invalid key {key} for this model", "code": 400}
    script = [
        openai_chunk(delta(0, role="assistant", content="Hel")),
        openai_chunk(delta(0, "error"), error=error),
    ]
    await fleet.start(1, upstream_api_key=key)
    job_id = await fleet.client.enqueue(chat("hi", script=script))
    record = await fleet.client.result(job_id, timeout=30)
    assert record.error is not None
    assert record.error["detail"]["message"] == "invalid key [REDACTED] for this model"
    events = [event async for event in fleet.client.events(job_id, block_ms=100)]
    assert key not in str(events[-1].data) and "[REDACTED]" in str(events[-1].data)
    output = await fleet.stop()
    assert key not in output
