"""The network between workers and Redis, and between a worker and its upstream, failing
slowly rather than cleanly (issue 22): ``chatstream worker`` processes reach Redis through
a TCP proxy the test partitions (tests/helpers/proxy.py: forwarding stopped, connections
left open, then healed or reset), and an upstream drips an event byte by byte
(docs/reliability.md, "Who may judge" and "Partitions"; docs/failures.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from schemas.events import EventType
from schemas.jobs import JobRecord
from tests.helpers.checks import all_terminal, check_stream, eventually, stream_entries
from tests.helpers.fleet import Fleet
from tests.helpers.harness import chat
from tests.helpers.proxy import TcpProxy
from tests.helpers.servers import RedisServer, needs_redis_server
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockUpstream, expected_reply

# one at a time on one test process: their workers' leases and heartbeats run on real clocks
pytestmark = pytest.mark.xdist_group("worker-processes")


@asynccontextmanager
async def behind_a_proxy(
    redis_server: RedisServer | None,
    redis: RedisClient,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    directory: Path,
    **settings: Any,
) -> AsyncIterator[tuple[Fleet, TcpProxy]]:
    """A fleet whose workers reach the session's Redis only through a proxy (the test's own
    client goes straight to Redis: the producer and the observer are not partitioned)."""
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    async with TcpProxy.serving("127.0.0.1", server.port) as proxy:
        through = f"redis://127.0.0.1:{proxy.port}/0"
        async with Fleet.session(directory, redis, through, prefix, url, mock=mock, **settings) as (
            fleet
        ):
            yield fleet, proxy


async def records(fleet: Fleet, ids: list[str]) -> list[JobRecord]:
    return [await fleet.client.get(job_id) for job_id in ids]


async def all_running(fleet: Fleet, ids: list[str]) -> bool:
    """Every job runs and has streamed some output."""
    for job_id in ids:
        if not await fleet.redis.xlen(fleet.keys.events(job_id)):
            return False
    return all(record.status == "running" for record in await records(fleet, ids))


async def enqueue(fleet: Fleet, requests: list[dict[str, Any]]) -> list[str]:
    return [await fleet.client.enqueue(request) for request in requests]


def assert_each_ran_once(
    fleet: Fleet, done: list[JobRecord], requests: list[dict[str, Any]]
) -> None:
    """Succeeded on its first attempt with the exact reply, from one upstream call."""
    for record, request in zip(done, requests, strict=True):
        assert (record.status, record.attempt) == ("succeeded", 1), record
        assert record.content == expected_reply(request, fleet.mock.config)
        assert fleet.mock.key_requests[request["mock"]["key"]] == 1, record.id


# -- 2. a partition of every worker, then every connection reset --------------------------

RUNNING_JOBS = 24
PARTITION_SECONDS = 6.0  # twice the heartbeat timeout, well inside the lease


async def test_after_a_partition_and_a_reset_no_live_workers_job_is_taken_over(
    redis_server: RedisServer | None,
    redis: RedisClient,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> None:
    """Three workers streaming 24 jobs (12 s each) lose Redis for 6 s (the heartbeat timeout
    is 3 s), their connections open; then the proxy resets every connection. Each worker's
    heartbeat hung through the partition and then succeeded (redis-py retried it): that
    is a break, so nobody judges until its beats were on time for the timeout, by which
    time every worker beats again. No job is taken over, reset, or called twice."""
    requests = [
        chat(f"p{i}", tokens=60, rate=5.0, key=f"{prefix}-p{i}") for i in range(RUNNING_JOBS)
    ]
    async with behind_a_proxy(redis_server, redis, prefix, mock_upstream, tmp_path) as (
        fleet,
        proxy,
    ):
        await fleet.start(3)
        ids = await enqueue(fleet, requests)

        await eventually(lambda: all_running(fleet, ids), timeout=20, every=0.1)
        connections = proxy.connections
        proxy.pause()
        await asyncio.sleep(PARTITION_SECONDS)
        proxy.reset()
        await eventually(lambda: all_terminal(redis, fleet.keys, ids), timeout=60, every=0.2)
        output = await fleet.stop()
    assert proxy.connections > connections  # the workers were cut off and connected again
    assert "took over" not in output, output
    assert "lease lost" not in output, output
    assert_each_ran_once(fleet, await records(fleet, ids), requests)
    for job_id in ids:
        types = [event.type for event in await stream_entries(redis, fleet.keys, job_id)]
        assert EventType.RESET not in types, job_id


async def test_a_worker_cut_off_alone_loses_its_jobs_and_takes_none(
    fleet: Fleet, prefix: str
) -> None:
    """Only one of three workers reaches Redis through the proxy, and it is cut off for 6 s
    (twice the heartbeat timeout), then its connections are reset. To the others it is
    dead: they take its jobs over and rerun them after a reset, as after a crash. Back, it
    learns it was declared dead and stops those jobs; it takes nothing over itself, and the
    others' jobs run once."""
    redis_port = int(fleet.env["CHATSTREAM_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    requests = [
        chat(f"a{i}", tokens=60, rate=5.0, key=f"{prefix}-a{i}") for i in range(RUNNING_JOBS)
    ]
    async with TcpProxy.serving("127.0.0.1", redis_port) as proxy:
        alone = fleet.spawn(redis_url=f"redis://127.0.0.1:{proxy.port}/0")
        await fleet.ready(alone)
        await fleet.start(2)
        ids = await enqueue(fleet, requests)
        await eventually(lambda: all_running(fleet, ids), timeout=20, every=0.1)
        on_alone = {r.id for r in await records(fleet, ids) if f"-{alone.pid}-" in (r.worker or "")}
        proxy.pause()
        await asyncio.sleep(PARTITION_SECONDS)
        proxy.reset()
        await eventually(lambda: all_terminal(fleet.redis, fleet.keys, ids), timeout=60, every=0.2)
        output = await fleet.stop()
    assert on_alone and len(on_alone) < RUNNING_JOBS  # it ran its share
    alone_log = fleet.logs[0].read_text()
    assert "this worker had been declared dead" in alone_log, alone_log
    assert "took over" not in alone_log, alone_log
    assert "took over" in output
    for record, request in zip(await records(fleet, ids), requests, strict=True):
        events = await stream_entries(fleet.redis, fleet.keys, record.id)
        check_stream(events, record)  # exact, whichever attempt finished it
        assert record.content == expected_reply(request, fleet.mock.config)
        resets = [event.type for event in events].count(EventType.RESET)
        assert (resets, record.attempt) == ((1, 2) if record.id in on_alone else (0, 1)), record.id
        calls = fleet.mock.key_requests[request["mock"]["key"]]
        assert calls == (2 if record.id in on_alone else 1), record.id


# -- 3. jobs queued during a partition, then it heals --------------------------------------

QUEUED_JOBS = 40
LONGER_THAN_THE_SOCKET_TIMEOUT = 13.0  # 12 s at the default block time: reads are given up on
STARTS_WITHIN = 5.0


async def test_jobs_queued_during_a_partition_start_within_seconds_after_it_heals(
    redis_server: RedisServer | None,
    redis: RedisClient,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> None:
    """Two workers with the default lease and block time are cut off for 13 s while 40 jobs
    are queued. Their queue reads hang past the socket timeout and are given up on; when
    the network heals, Redis serves some of those reads (their replies go to closed
    sockets), so the entries are the workers' own, unseen. The workers look for such
    entries at once: every job starts within 5 s of the heal, not half a lease later."""
    requests = [chat(f"q{i}", tokens=5, key=f"{prefix}-q{i}") for i in range(QUEUED_JOBS)]
    async with behind_a_proxy(
        redis_server, redis, prefix, mock_upstream, tmp_path, block_ms=2000
    ) as (fleet, proxy):
        await fleet.start(2)
        proxy.pause()
        ids = await enqueue(fleet, requests)  # served to reads already sent, or waiting
        await asyncio.sleep(LONGER_THAN_THE_SOCKET_TIMEOUT)
        healed = time.time()
        proxy.resume()
        await eventually(lambda: all_terminal(redis, fleet.keys, ids), timeout=40, every=0.2)
        output = await fleet.stop()
    done = await records(fleet, ids)
    assert_each_ran_once(fleet, done, requests)
    waited = {record.id: (record.started_at or healed) - healed for record in done}
    late = {
        job_id: round(seconds, 1) for job_id, seconds in waited.items() if seconds > STARTS_WITHIN
    }
    assert not late, (late, output)
    assert "took over" not in output, output


# -- 1. an upstream that drips bytes ---------------------------------------------------------

IDLE_TIMEOUT = 2.0


async def test_an_upstream_dripping_an_event_ends_the_attempt_at_the_idle_timeout(
    fleet: Fleet, prefix: str
) -> None:
    """After three tokens the upstream sends one byte every 0.2 s of an event it never ends.
    Each attempt ends at the idle timeout (2 s; the job timeout is 60 s) and is retried like
    one: the job that drips once succeeds on its second attempt, after a reset; the job that
    always drips fails after its three attempts, saying the upstream stalled mid-event."""
    await fleet.start(1, idle_timeout=IDLE_TIMEOUT, job_timeout=60, retry_after_output="true")
    drip = {"fault": "drip", "drip_seconds": 0.2, "fault_after": 3}
    once = chat("drips once", **drip, fail_times=1, key=f"{prefix}-once")
    always = chat("drips always", **drip, key=f"{prefix}-always")
    ids = await enqueue(fleet, [once, always])
    await eventually(lambda: all_terminal(fleet.redis, fleet.keys, ids), timeout=45, every=0.2)
    await fleet.stop()
    recovered, stalled = await records(fleet, ids)
    assert (recovered.status, recovered.attempt) == ("succeeded", 2), recovered.error
    assert recovered.content == expected_reply(once, fleet.mock.config)
    events = await stream_entries(fleet.redis, fleet.keys, recovered.id)
    assert [event.type for event in events].count(EventType.RESET) == 1
    assert (stalled.status, stalled.attempt) == ("failed", 3)
    assert stalled.error is not None and stalled.error["code"] == "upstream_timeout"
    message = stalled.error["message"]
    assert message.startswith("upstream 'default': stalled mid-event: sent "), message
    assert message.endswith(
        f"bytes of an event but no complete SSE event or comment for {IDLE_TIMEOUT:g}s"
    )
    assert fleet.mock.key_requests[f"{prefix}-always"] == 3
    assert fleet.mock.key_requests[f"{prefix}-once"] == 2
