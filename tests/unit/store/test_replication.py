"""What happens when Redis loses writes it acknowledged.

A failover to a replica that lacked the last writes leaves a job's record *behind* what
its worker was told had landed. Here that is made by hand on the real redis-server (the
record rewound under a running job) so each case is exact; tests/system/test_failover.py
makes it with real failovers, and tests/system/test_replication.py waits for real
replicas (WAIT).
"""

from __future__ import annotations

import asyncio

import pytest

from schemas.events import EventType
from tests.helpers.checks import (
    check_stream,
    eventually,
    queue_is_drained,
    status_of,
    stream_entries,
)
from tests.helpers.harness import Harness, chat
from worker.aio import cancel_and_wait
from worker.store.publisher import JobStream
from worker.store.records import ALREADY, NOT_YET, WRITTEN

# -- the publisher notices a record that fell behind ------------------------------------------


def test_not_yet_right_after_a_confirmed_entry_means_redis_lost_it() -> None:
    stream = JobStream("j", 1)
    stream.seq, stream.unconfirmed = 3, [(1, "a"), (2, "b"), (3, "c")]
    assert stream.settle_delta(1, WRITTEN) is False
    assert stream.settle_delta(2, NOT_YET) is False and stream.rolled_back and stream.stale


def test_not_yet_behind_an_unconfirmed_entry_is_only_a_resend() -> None:
    stream = JobStream("j", 1)
    stream.seq, stream.unconfirmed = 3, [(1, "a"), (2, "b"), (3, "c")]
    assert stream.settle_delta(1, ALREADY) is False
    # 2 was refused (not answered NOT_YET): 3 waits for it, as usual
    assert stream.settle_delta(3, NOT_YET) is True and not stream.rolled_back


async def rewind_while_streaming(h: Harness, field: str, value: str) -> str:
    """A job streaming slowly; once it has 5 delta entries, its record's ``field`` is set
    to ``value`` (what a failover that lost recent writes leaves); returns the job id."""
    keys = h.worker.keys
    job_id = await h.client.enqueue(chat("rewound", tokens=60, rate=20))  # 3 s
    consume = asyncio.create_task(h.worker.consume())
    try:

        async def five_deltas() -> bool:
            return len(await stream_entries(h.redis, keys, job_id)) >= 5

        await eventually(five_deltas)
        await h.redis.hset(keys.job(job_id), field, value)
        await eventually(lambda: ended(h, job_id), timeout=20)
    finally:
        h.worker.stopping.set()
        await cancel_and_wait([consume])
    return job_id


async def ended(h: Harness, job_id: str) -> bool:
    return await status_of(h.redis, h.worker.keys, job_id) in ("succeeded", "failed")


@pytest.mark.parametrize(
    ("field", "value"),
    [("seq", "2"), ("attempt", "0")],
    ids=["confirmed-deltas-lost", "start-lost"],
)
async def test_a_job_whose_record_fell_behind_is_rerun_with_a_reset(
    harness: Harness, field: str, value: str
) -> None:
    job_id = await rewind_while_streaming(harness, field, value)
    record = await harness.client.get(job_id)
    events = await stream_entries(harness.redis, harness.worker.keys, job_id)
    assert record.status == "succeeded" and record.attempt == 2, (record, events)
    check_stream(events, record)  # one terminal entry; the deltas after the reset are whole
    assert [e.type for e in events].count(EventType.RESET) == 1
    # acked right after its terminal write (which the test saw land first)
    await eventually(lambda: queue_is_drained(harness.redis, harness.worker.keys))
