"""What the tests check: against Redis, that a job's stream and record agree, the queue is
drained, jobs are terminal; a worker's readiness; and ``eventually``, the wait for a
condition."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from redis.exceptions import RedisError

from schemas.events import EventType, StreamEvent
from schemas.jobs import EXTRAS, JobRecord, JobStatus
from tests.helpers.harness import MOCK_PROCESS
from worker.client import Client
from worker.protocol.accumulator import Delta, FinalMessage
from worker.store.keys import GROUP, Keys
from worker.store.redis_client import RedisClient
from worker.store.stats import queue_counts
from worker.testing.mock_upstream import expected_reply

TERMINAL = ("succeeded", "failed", "cancelled")
TERMINAL_TYPE = {
    JobStatus.SUCCEEDED: EventType.DONE,
    JobStatus.FAILED: EventType.ERROR,
    JobStatus.CANCELLED: EventType.CANCELLED,
}


async def stream_entries(redis: RedisClient, keys: Keys, job_id: str) -> list[StreamEvent]:
    """Every entry of the job's events stream, as stored."""
    rows: Any = await redis.xrange(keys.events(job_id))
    return [StreamEvent.from_entry(str(eid), dict(fields)) for eid, fields in rows]


@dataclass
class Merged:
    """A job's published deltas merged by ``Delta.merge`` (what the publisher runs)."""

    data: Delta  # the merged delta, published form

    @property
    def role(self) -> str | None:
        return self.data.get("role")

    @property
    def content(self) -> str:
        return str(self.data.get("content", ""))

    @property
    def refusal(self) -> str:
        return str(self.data.get("refusal", ""))

    @property
    def reasoning_details(self) -> list[dict[str, Any]]:
        return list(self.data.get("reasoning_details", []))

    @property
    def tool_calls(self) -> list[dict[str, Any]]:  # fragments merged by index
        return list(self.data.get("tool_calls", []))


def merged(deltas: Iterable[dict[str, Any]]) -> Merged:
    """``deltas`` (published form) merged in order."""
    out = Delta()
    for delta in deltas:
        out.merge(delta)
    return Merged(out)


def merge_deltas(events: list[StreamEvent]) -> Merged:
    """The deltas of the last attempt merged in order (a ``reset`` voids earlier ones)."""
    start = max((i + 1 for i, e in enumerate(events) if e.type is EventType.RESET), default=0)
    return merged(e.data for e in events[start:] if e.type is EventType.DELTA)


def record_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merged tool-call fragments in the record's shape (index order, no ``index``)."""
    out = []
    for call in sorted(calls, key=lambda call: int(call["index"])):
        function = call.get("function", {})
        name, arguments = function.get("name", ""), function.get("arguments", "")
        out.append(
            {
                "id": call.get("id", ""),
                "type": call.get("type") or "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    return out


def final_tool_calls(delta: Merged) -> list[dict[str, Any]]:
    return record_calls(delta.tool_calls)


OUTPUT = ("content", "refusal", "reasoning", "tool_calls")


def output_of(reply: Merged | FinalMessage | JobRecord) -> dict[str, Any]:
    """What merged deltas, the final message and the record must agree on: content,
    refusal, reasoning and tool calls (the record's shape), of choice 0 and the others."""
    if isinstance(reply, Merged):
        top = _published_output(reply.data)
        others = {c["index"]: _published_output(c) for c in reply.data.get("choices", [])}
    else:
        top = {key: getattr(reply, key) for key in OUTPUT}
        others = {c["index"]: {key: c[key] for key in OUTPUT} for c in reply.choices or []}
    return {**top, "choices": {i: out for i, out in others.items() if any(out.values())}}


def _published_output(delta: dict[str, Any]) -> dict[str, Any]:
    return {
        "content": delta.get("content", ""),
        "refusal": delta.get("refusal", ""),
        "reasoning": delta.get("reasoning_details", []),
        "tool_calls": record_calls(delta.get("tool_calls", [])),
    }


def check_stream(events: list[StreamEvent], record: JobRecord) -> Merged:
    """The invariants every finished job's stream keeps; returns the merged deltas."""
    assert record.terminal, record
    terminals = [event for event in events if event.terminal]
    assert len(terminals) == 1, [e.type for e in events]
    assert events[-1] is terminals[0]
    assert events[-1].type is TERMINAL_TYPE[record.status]
    assert events[-1].attempt == record.attempt
    assert all(e.type in (EventType.DELTA, EventType.RESET, EventType.WAITING) for e in events[:-1])
    for i, waiting in enumerate(events):  # an attempt waits only before its first delta
        if waiting.type is EventType.WAITING:
            earlier = events[:i]
            assert not any(
                e.type is EventType.DELTA and e.attempt == waiting.attempt for e in earlier
            )
    ids = [tuple(int(part) for part in e.id.split("-")) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    merged = merge_deltas(events)
    if record.status is not JobStatus.CANCELLED:
        assert output_of(merged) == output_of(record)
    if record.status is JobStatus.FAILED:
        assert record.error is not None
        assert events[-1].data["error"] == record.error
    else:
        assert record.error is None
    if record.status is JobStatus.SUCCEEDED:
        assert events[-1].data == terminal_data(record)
    return merged


def terminal_data(record: JobRecord) -> dict[str, Any]:
    """A succeeded job's ``done`` entry, from its record."""
    data: dict[str, Any] = {"finish_reason": record.finish_reason, "usage": record.usage}
    data.update((name, getattr(record, name)) for name in EXTRAS if getattr(record, name))
    if record.served_upstream:
        data["served"] = {"upstream": record.served_upstream}
        if record.served_model:
            data["served"]["model"] = record.served_model
    if record.choices:
        data["choices"] = [{"index": c["index"], "finish_reason": c["finish_reason"]}
                           for c in record.choices]  # fmt: skip
    return data


async def queue_is_empty(redis: RedisClient, keys: Keys) -> bool:
    return await queue_is_drained(redis, keys)


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 10, every: float = 0.02
) -> None:
    """Wait until ``check()`` is true (TimeoutError after ``timeout`` seconds)."""
    async with asyncio.timeout(timeout):
        while True:
            if await check():
                return
            await asyncio.sleep(every)


async def status_of(redis: RedisClient, keys: Keys, job_id: str) -> str | None:
    status: Any = await redis.hget(keys.job(job_id), "status")
    return None if status is None else str(status)


async def queue_is_drained(redis: RedisClient, keys: Keys) -> bool:
    """No queue entry left on any shard, none pending, no job waiting in a tenant's queue:
    every job was dispatched and its entry acked and deleted."""
    for key in keys.queues:
        pending: Any = await redis.xpending(key, GROUP)
        if int(await redis.xlen(key)) != 0 or pending["pending"] != 0:
            return False
    return (await queue_counts(redis, keys)).scheduled == 0


async def jobs_queued(redis: RedisClient, keys: Keys) -> int:
    """Jobs in the queue: stream entries (waiting or running) and tenants' queues."""
    counts = await queue_counts(redis, keys)
    return counts.length + counts.scheduled


def after_last_reset(events: list[StreamEvent]) -> list[StreamEvent]:
    resets = [i for i, e in enumerate(events) if e.type is EventType.RESET]
    return events[resets[-1] + 1 :] if resets else events


async def statuses(redis: RedisClient, keys: Keys, ids: list[str]) -> list[str | None]:
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keys.job(job_id), "status")
    result: list[str | None] = await pipe.execute()
    return result


async def all_terminal(redis: RedisClient, keys: Keys, ids: list[str]) -> bool:
    try:
        return all(status in TERMINAL for status in await statuses(redis, keys, ids))
    except RedisError:  # Redis is being restarted, or refuses commands
        return False


def check_job(request: dict[str, Any], record: JobRecord, events: list[StreamEvent]) -> None:
    """Succeeded, exactly the expected content (mock process), the stream agreeing with the
    record: one terminal entry, one ``reset`` per rerun, gapless deltas after the last one."""
    assert record.status == "succeeded", (record.id, record.error)
    assert record.content == expected_reply(request, MOCK_PROCESS), record.id
    check_stream(events, record)  # one terminal entry, last; merged deltas == record
    resets = [e for e in events if e.type is EventType.RESET]
    assert len(resets) == record.attempt - 1, record.id  # one per rerun, no more
    assert {e.attempt for e in after_last_reset(events)} == {record.attempt}, record.id
    assert merge_deltas(after_last_reset(events)).content == record.content


async def check_all(
    redis: RedisClient, keys: Keys, requests: list[dict[str, Any]], ids: list[str]
) -> list[JobRecord]:
    """``check_job`` for every job; the queue drained, no dead letters."""
    client = Client(redis, prefix=keys.prefix)
    records = []
    for request, job_id in zip(requests, ids, strict=True):
        record = await client.get(job_id)
        check_job(request, record, await stream_entries(redis, keys, job_id))
        records.append(record)
    assert await queue_is_drained(redis, keys)
    assert await redis.xlen(keys.dead) == 0
    return records


async def readiness(port: int) -> tuple[int, dict[str, Any]]:
    """A worker's ``/readyz`` on its metrics port: the status code and the body."""
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(f"http://127.0.0.1:{port}/readyz")
        return response.status_code, response.json()


async def is_ready(port: int) -> bool:
    return (await readiness(port))[0] == 200


async def until_serving(http: httpx.AsyncClient, timeout: float = 20) -> None:
    """Until the gateway behind ``http`` answers ``/healthz`` with 200."""

    async def up() -> bool:
        try:
            return (await http.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    await eventually(up, timeout=timeout, every=0.1)
