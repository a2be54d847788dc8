"""The client API end to end: enqueue, events (live, resumable), result, cancel, SyncClient."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobStatus
from schemas.requests import MAX_NESTING, ChatRequest, nesting_depth
from tests.helpers.checks import (
    check_stream,
    jobs_queued,
    merge_deltas,
    queue_is_empty,
    stream_entries,
)
from tests.helpers.harness import MOCK, Harness, chat
from worker.client import Client, SyncClient, within
from worker.errors import InvalidJobError, JobNotFoundError
from worker.settings import Settings
from worker.store.scheduler import config_fields
from worker.testing.mock_upstream import expected_reply

COMPLETIONS = "/v1/chat/completions"


async def collect(client: Client, job_id: str, after: str = "0-0") -> list[StreamEvent]:
    return [event async for event in client.events(job_id, after=after, block_ms=100)]


# -- enqueue ------------------------------------------------------------------------------


async def test_unknown_upstream_is_rejected_at_enqueue(harness: Harness) -> None:
    with pytest.raises(InvalidJobError, match="unknown upstream 'elsewhere'"):
        await harness.client.enqueue(chat(), job_id="j1", upstream="elsewhere")
    keys = harness.worker.keys
    assert await harness.redis.exists(keys.job("j1")) == 0
    assert await harness.redis.xlen(keys.queue) == 0


async def test_an_upstream_the_workers_publish_is_accepted_without_its_settings(
    harness: Harness,
) -> None:
    """The workers publish the names they serve; a producer that knows only ``default``
    accepts ``slow`` once they do, and still refuses a name nobody serves."""
    producer = Client(harness.redis, prefix=harness.worker.keys.prefix, upstreams=["default"])
    with pytest.raises(InvalidJobError, match=r"served by the workers on prefix .*: \['default'\]"):
        await producer.enqueue(chat(), job_id="j1", upstream="slow")
    served = Settings(upstreams={"slow": {"url": "http://127.0.0.1:9/v1"}})
    await harness.worker.queue.scheduler.publish(config_fields(served))
    assert await producer.enqueue(chat(), job_id="j1", upstream="slow") == "j1"
    assert (await producer.get("j1")).upstream == "slow"
    with pytest.raises(InvalidJobError, match="unknown upstream 'http://x'"):
        await producer.enqueue(chat(), job_id="j2", upstream="http://x")
    assert await harness.redis.exists(harness.worker.keys.job("j2")) == 0


@pytest.mark.parametrize(
    ("request_body", "job_id", "match"),
    [
        ({"model": "m"}, None, "request.messages: Field required"),
        ({"model": "m", "messages": []}, None, "request.messages: List should have at least"),
        (chat(), "has spaces", "id: String should match pattern"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x" * 1_100_000}]},
            None,
            "larger than the limit",
        ),
    ],
)
async def test_invalid_jobs_are_rejected_at_enqueue(
    harness: Harness, request_body: dict[str, Any], job_id: str | None, match: str
) -> None:
    with pytest.raises(InvalidJobError, match=match):
        await harness.client.enqueue(request_body, job_id=job_id)
    assert await harness.redis.xlen(harness.worker.keys.queue) == 0
    assert await harness.redis.keys(f"{harness.settings.prefix}:job:*") == []


def nested(levels: int) -> Any:
    """A message content ``levels`` JSON arrays deep."""
    value: Any = "deep"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("levels", [126, 200, 300, 5_000])
async def test_a_request_nested_deeper_than_a_worker_runs_is_refused_before_any_write(
    harness: Harness, levels: int
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": nested(levels)}]}
    with pytest.raises(InvalidJobError, match=f"nested more than {MAX_NESTING} levels deep"):
        await harness.client.enqueue(body, job_id="deep")
    with pytest.raises(InvalidJobError, match=r"requests\[1\]: .*nested more than"):
        await harness.client.enqueue_many([chat(), body])
    with pytest.raises(InvalidJobError, match="metadata is nested more than"):
        await harness.client.enqueue(chat(), metadata={"m": nested(levels + 3)})
    assert await harness.redis.exists(harness.worker.keys.job("deep")) == 0
    assert await jobs_queued(harness.redis, harness.worker.keys) == 0


def reference_depth(value: Any) -> int:
    """JSON levels, recursively (the obvious definition nesting_depth must agree with)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return 1 + max((reference_depth(item) for item in value), default=0)
    return 0


json_values = st.recursive(
    st.none() | st.integers() | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children)
        | st.dictionaries(st.text(max_size=2), children, max_size=3)
    ),
    max_leaves=40,
)


@settings(max_examples=500, deadline=None)
@given(json_values, st.integers(0, 8))
def test_nesting_depth_counts_json_levels_up_to_its_bound(value: Any, stop_after: int) -> None:
    depth = reference_depth(value)
    assert nesting_depth(value, stop_after) == min(depth, stop_after + 1)


def test_nesting_depth_counts_a_model_as_the_dict_of_its_fields() -> None:
    request = ChatRequest.model_validate(chat())
    assert nesting_depth(request) == reference_depth(request.model_dump(exclude_unset=True))
    assert nesting_depth({"r": [request]}) == 2 + nesting_depth(request)


async def test_a_request_at_the_nesting_bound_runs(harness: Harness) -> None:
    # the body 1, messages 2, the message 3, then the content's arrays: 128 levels in all
    body = {"model": "m", "messages": [{"role": "user", "content": nested(MAX_NESTING - 3)}]}
    record = await harness.run(body)
    assert record.status is JobStatus.SUCCEEDED, record.error


async def test_enqueue_is_idempotent_per_job_id(harness: Harness) -> None:
    keys = harness.worker.keys
    request = chat("once only", key="idem")
    first = await harness.client.enqueue(request, job_id="same", metadata={"user": 7})
    second = await harness.client.enqueue(chat("something else"), job_id="same")
    assert first == second == "same"
    assert await harness.redis.xlen(keys.queue) == 1
    queued = await harness.client.get("same")
    assert queued.status == "queued"
    assert queued.attempt == 0
    assert queued.metadata == {"user": 7}
    assert queued.request is not None
    assert queued.request["messages"][0]["content"] == "once only"  # the first one wins
    await harness.worker.run_burst()
    record = await harness.client.get("same")
    assert record.status == "succeeded"
    assert record.content == expected_reply(request, MOCK)
    assert harness.mock.key_requests["idem"] == 1
    # enqueueing a finished job again changes nothing
    assert await harness.client.enqueue(request, job_id="same") == "same"
    assert await harness.redis.xlen(keys.queue) == 0
    await harness.worker.run_burst()
    assert harness.mock.key_requests["idem"] == 1
    assert await harness.client.get("same") == record


async def test_generated_job_ids_are_distinct(harness: Harness) -> None:
    ids = {await harness.client.enqueue(chat()) for _ in range(5)}
    assert len(ids) == 5
    assert await jobs_queued(harness.redis, harness.worker.keys) == 5


# -- events -------------------------------------------------------------------------------


async def test_events_resume_after_an_entry_id(harness: Harness) -> None:
    record = await harness.run(chat("resume me", tokens=200, rate=2000))
    events = await collect(harness.client, record.id)
    assert len(events) >= 3, [e.type for e in events]
    check_stream(events, record)
    assert events == await stream_entries(harness.redis, harness.worker.keys, record.id)
    for k in (0, 1, len(events) // 2, len(events) - 2):
        later = await collect(harness.client, record.id, after=events[k].id)
        assert later == events[k + 1 :]
    # resuming at the terminal entry: nothing more comes, and the call returns at once
    # (docs/consumers.md), even with the default 2 s blocking read
    after_end = harness.client.events(record.id, after=events[-1].id)
    assert await asyncio.wait_for(anext(after_end, None), 1) is None


async def test_events_of_a_queued_job_wait_then_stream_live(harness: Harness) -> None:
    client = harness.client
    job_id = await client.enqueue(chat("live", tokens=30, rate=60))
    seen: list[StreamEvent] = []
    status_at_first_delta: list[str] = []

    async def consume() -> None:
        async for event in client.events(job_id, block_ms=100):
            if not seen:
                status_at_first_delta.append((await client.get(job_id)).status.value)
            seen.append(event)

    consumer = asyncio.create_task(consume())
    await asyncio.sleep(0.4)  # several blocking reads with nothing to read
    assert not consumer.done()
    assert seen == []
    await asyncio.gather(harness.worker.run_burst(), asyncio.wait_for(consumer, 10))
    record = await client.get(job_id)
    assert status_at_first_delta == ["running"]  # the first delta arrived while it ran
    check_stream(seen, record)
    assert merge_deltas(seen).content == expected_reply(chat(tokens=30), MOCK)
    assert seen == await stream_entries(harness.redis, harness.worker.keys, job_id)


async def test_several_consumers_see_the_same_stream(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("fan out", tokens=40, rate=400))
    readers = [asyncio.create_task(collect(harness.client, job_id)) for _ in range(3)]
    await asyncio.sleep(0.05)
    await harness.worker.run_burst()
    results = await asyncio.wait_for(asyncio.gather(*readers), 10)
    assert results[0] == results[1] == results[2]
    check_stream(results[0], await harness.client.get(job_id))


async def test_events_end_when_the_record_expires_while_waiting(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat())
    reader = asyncio.create_task(collect(harness.client, job_id))
    await asyncio.sleep(0.15)
    assert not reader.done()
    await harness.redis.delete(harness.worker.keys.job(job_id))  # as if it expired
    assert await asyncio.wait_for(reader, 2) == []


async def test_events_and_get_of_an_unknown_job(harness: Harness) -> None:
    with pytest.raises(JobNotFoundError, match="no job 'nope'"):
        await collect(harness.client, "nope")
    with pytest.raises(JobNotFoundError):
        await harness.client.get("nope")
    with pytest.raises(JobNotFoundError):
        await harness.client.result("nope", timeout=1)
    with pytest.raises(JobNotFoundError):
        await harness.client.cancel("nope")


# -- result -------------------------------------------------------------------------------


async def test_result_times_out_on_a_job_nobody_runs(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat())
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(TimeoutError):
        await harness.client.result(job_id, timeout=0.3)
    assert 0.25 <= loop.time() - began < 2
    assert (await harness.client.get(job_id)).status == "queued"


async def test_result_waits_for_the_terminal_state(harness: Harness) -> None:
    job_id = await harness.client.enqueue(chat("wait", tokens=20, rate=200))
    waiter = asyncio.create_task(harness.client.result(job_id, timeout=10))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await harness.worker.run_burst()
    record = await waiter
    assert record.status == "succeeded"
    assert record.content == expected_reply(chat(tokens=20), MOCK)
    # a finished job's result is immediate
    assert await harness.client.result(job_id, timeout=0.5) == record


# -- cancel -------------------------------------------------------------------------------


async def test_cancel_of_a_queued_job(harness: Harness) -> None:
    client = harness.client
    job_id = await client.enqueue(chat("never mind", key="cq"))
    assert await client.cancel(job_id) == "cancelled"
    record = await client.get(job_id)
    assert record.status == "cancelled"
    assert record.cancel_requested
    assert record.attempt == 0
    await harness.worker.run_burst()
    assert harness.mock.requests[COMPLETIONS] == 0
    assert harness.mock.key_requests["cq"] == 0
    record = await client.get(job_id)
    assert record.status == "cancelled"
    assert record.started_at is None
    events = await stream_entries(harness.redis, harness.worker.keys, job_id)
    assert [e.type for e in events] == [EventType.CANCELLED]
    check_stream(events, record)
    assert await collect(client, job_id) == events
    assert await client.result(job_id, timeout=1) == record
    assert await queue_is_empty(harness.redis, harness.worker.keys)
    # cancelling again reports the state it reached
    assert await client.cancel(job_id) == "cancelled"
    assert len(await stream_entries(harness.redis, harness.worker.keys, job_id)) == 1


async def test_cancel_of_a_running_job_closes_the_upstream(harness: Harness) -> None:
    client = harness.client
    job_id = await client.enqueue(chat("long", tokens=2000, rate=100, key="cr"))
    burst = asyncio.create_task(harness.worker.run_burst())
    events: list[StreamEvent] = []
    loop = asyncio.get_running_loop()
    cancelled_at = 0.0
    async with asyncio.timeout(10):
        async for event in client.events(job_id, block_ms=100):
            events.append(event)
            if len(events) == 1:
                assert event.type is EventType.DELTA
                assert await client.cancel(job_id) == "requested"
                cancelled_at = loop.time()
        await burst
    assert loop.time() - cancelled_at < 2
    record = await client.get(job_id)
    assert record.status == "cancelled"
    check_stream(events, record)
    assert events[-1].type is EventType.CANCELLED
    assert events[-1].attempt == 1
    await asyncio.wait_for(harness.mock.disconnected.wait(), 2)
    assert [key for key, _ in harness.mock.disconnects] == ["cr"]
    assert harness.mock.key_requests["cr"] == 1
    assert await queue_is_empty(harness.redis, harness.worker.keys)
    assert await client.cancel(job_id) == "cancelled"


async def test_cancel_of_a_finished_job_changes_nothing(harness: Harness) -> None:
    record = await harness.run(chat("done"))
    before = await stream_entries(harness.redis, harness.worker.keys, record.id)
    assert await harness.client.cancel(record.id) == "succeeded"
    assert await harness.client.get(record.id) == record
    assert await stream_entries(harness.redis, harness.worker.keys, record.id) == before


# -- SyncClient ---------------------------------------------------------------------------


def _sync_flow(harness: Harness, job_ready: asyncio.Event, loop: asyncio.AbstractEventLoop) -> Any:
    """Runs in a thread: the worker (in the test's loop) runs jobs only after job_ready."""
    with SyncClient(harness.settings) as client:
        job_id = client.enqueue(chat("sync", tokens=15), job_id="sync-1")
        assert client.enqueue(chat("sync"), job_id="sync-1") == "sync-1"
        assert client.get(job_id).status == "queued"
        other = client.enqueue(chat("cancel me"))
        cancelled = client.cancel(other)
        with pytest.raises(TimeoutError):
            client.result(job_id, timeout=0.2)
        with pytest.raises(JobNotFoundError):
            client.get("missing")
        loop.call_soon_threadsafe(job_ready.set)
        events = list(client.events(job_id))
        record = client.result(job_id, timeout=10)
        assert client.get(other).status == "cancelled"
        return events, record, cancelled


async def test_sync_client_in_a_thread(harness: Harness) -> None:
    job_ready = asyncio.Event()
    flow = asyncio.create_task(
        asyncio.to_thread(_sync_flow, harness, job_ready, asyncio.get_running_loop())
    )
    await asyncio.wait_for(job_ready.wait(), 10)
    await harness.worker.run_burst()
    events, record, cancelled = await asyncio.wait_for(flow, 20)
    assert record.status == "succeeded"
    assert record.content == expected_reply(chat(tokens=15), MOCK)
    check_stream(events, record)
    assert cancelled == "cancelled"


async def test_within_holds_its_deadline_when_a_cancellation_is_swallowed() -> None:
    """redis-py can swallow a cancellation (worker.tasks.cancel_and_wait); asyncio.timeout
    would then let the work run on to its end, ``within`` stops it anyway."""
    swallowed: list[bool] = []

    async def stubborn() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.append(True)  # like a redis-py read whose reply raced the cancel
        await asyncio.sleep(30)
        return "ran on"

    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await within(stubborn(), 0.1)
    assert swallowed == [True]
    assert time.monotonic() - began < 10  # not the 30 s the work would take
    assert await within(asyncio.sleep(0, "quick"), 1) == "quick"
    assert await within(asyncio.sleep(0, "no limit"), None) == "no limit"
