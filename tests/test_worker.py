"""End to end in one process: real redis-server, mock upstream on loopback, one worker."""

from __future__ import annotations

from schemas.events import EventType
from tests.conftest import Harness, chat
from worker.accumulator import Delta
from worker.mock_upstream import MockConfig, expected_reply, expected_usage


async def test_plain_text_job_streams_deltas_and_records_the_reply(harness: Harness) -> None:
    request = chat("hi", tokens=30)
    record = await harness.run(request)
    config = MockConfig(tokens=30)
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, config)
    assert record.usage == expected_usage(request, config)
    assert record.finish_reason == "stop"
    events = await harness.events(record.id)
    assert [e.type for e in events[:-1]] == [EventType.DELTA] * (len(events) - 1)
    assert events[-1].type is EventType.DONE
    merged = Delta()
    for event in events[:-1]:
        merged.merge(Delta.from_json(event.data))
    assert merged.role == "assistant"
    assert merged.content == record.content
