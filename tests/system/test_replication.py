"""Waiting for replicas (WAIT): CHATSTREAM_REDIS_WAIT_REPLICAS against a real master of the
test's own, first with no replica (WAIT times out), then with one attached
(redis-server --replicaof). What happens when Redis loses writes it acknowledged is in
``tests/unit/store/test_replication.py`` (made by hand) and test_failover.py (made by
real failovers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from tests.helpers.checks import (
    check_stream,
    eventually,
    jobs_queued,
    queue_is_drained,
    stream_entries,
)
from tests.helpers.gateway_env import running_gateway
from tests.helpers.harness import chat
from tests.helpers.servers import RedisServer, redis_executable
from worker.client import Client
from worker.errors import NotReplicatedError
from worker.service.worker import Worker
from worker.settings import Settings

# -- waiting for replicas -----------------------------------------------------------------------


@pytest.fixture
async def master(own_redis: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(own_redis.url, decode_responses=True)
    yield client
    await client.aclose()


# with a replica attached, its acknowledgement may take longer than 300 ms on a busy machine
PATIENT: dict[str, Any] = {"redis_wait_timeout_ms": 5_000}


def waiting(settings: Settings, server: RedisServer, **updates: object) -> Settings:
    return settings.model_copy(
        update={
            "redis_url": server.url,
            "redis_wait_replicas": 1,
            "redis_wait_timeout_ms": 300,
            **updates,
        }
    )


async def start_replica(master: RedisServer, directory: Path) -> RedisServer:
    """A replica of ``master``, once the master counts it online (WAIT counts only those)."""
    executable = redis_executable()
    assert executable is not None
    directory.mkdir()  # noqa: ASYNC240 (a local directory, before any server runs)
    replica = RedisServer(executable, directory, "--replicaof", "127.0.0.1", str(master.port))
    replica.start()
    client = Redis.from_url(master.url, decode_responses=True)
    try:

        async def online() -> bool:
            info = await client.info("replication")
            return bool(info.get("slave0", {}).get("state") == "online")

        await eventually(online, timeout=20)
    finally:
        await client.aclose()
    return replica


async def run_worker(config: Settings, redis: Redis) -> int:
    """A worker started, run until the queue is empty, stopped; the jobs it ran."""
    worker = Worker(config, redis)
    await worker.startup()
    try:
        return await worker.run_burst()
    finally:
        await worker.shutdown()


async def test_enqueue_without_a_replica_raises_yet_queues_the_job(
    own_redis: RedisServer, master: Redis, settings: Settings, tmp_path: Path
) -> None:
    config = waiting(settings, own_redis)
    client = Client.from_settings(config, master)
    began = time.monotonic()
    with pytest.raises(NotReplicatedError, match="0 of 1 replicas acknowledged it within 300 ms"):
        await client.enqueue(chat("no replica"), job_id="lonely")
    assert time.monotonic() - began < 3  # one bounded WAIT, not a hang
    assert (await client.get("lonely")).status == "queued"  # the master has it all the same
    assert await jobs_queued(master, client.keys) == 1
    replica = await start_replica(own_redis, tmp_path / "replica")
    patient = Client.from_settings(config.model_copy(update=PATIENT), master)
    try:
        assert await patient.enqueue(chat("no replica"), job_id="lonely") == "lonely"  # now it is
        assert await patient.enqueue(chat("with replica"), job_id="paired") == "paired"
        assert await jobs_queued(master, client.keys) == 2
    finally:
        replica.stop()
        await client.replication.aclose()
        await patient.replication.aclose()


async def test_a_job_is_acked_only_once_a_replica_has_its_terminal_state(
    own_redis: RedisServer,
    master: Redis,
    settings: Settings,
    mock_upstream: tuple[object, str],
    tmp_path: Path,
) -> None:
    """No replica: the job succeeds (consumers see it all), but its queue entry stays.
    Whoever takes it next (here: the entry the stopping worker handed back, read by a new
    worker) checks again; with a replica attached by then, it is acked. Nothing runs
    twice."""
    _, url = mock_upstream
    config = waiting(settings, own_redis, upstream_url=url, lease_seconds=1.5)
    producer = Client.from_settings(config.model_copy(update={"redis_wait_replicas": 0}), master)
    job_id = await producer.enqueue(chat("durable", tokens=4))
    assert await run_worker(config, master) == 1
    record = await producer.get(job_id)
    assert record.status == "succeeded" and record.attempt == 1
    # not acked: no replica has the terminal state (the stopping worker handed it back)
    assert await master.xlen(producer.keys.queue) == 1
    replica = await start_replica(own_redis, tmp_path / "replica")
    try:
        await asyncio.sleep(config.lease_seconds)  # the entry's lease runs out
        await run_worker(config.model_copy(update=PATIENT), master)
        assert await queue_is_drained(master, producer.keys)
    finally:
        replica.stop()
    after = await producer.get(job_id)
    assert (after.status, after.attempt) == ("succeeded", 1)  # checked, not run again
    events = await stream_entries(master, producer.keys, job_id)
    check_stream(events, after)


async def test_the_terminal_write_waits_for_the_replica_when_there_is_one(
    own_redis: RedisServer,
    master: Redis,
    settings: Settings,
    mock_upstream: tuple[object, str],
    tmp_path: Path,
) -> None:
    _, url = mock_upstream
    replica = await start_replica(own_redis, tmp_path / "replica")
    config = waiting(settings, own_redis, upstream_url=url, **PATIENT)
    try:
        client = Client.from_settings(config, master)
        ids = [await client.enqueue(chat(f"pair {i}", tokens=3)) for i in range(5)]
        assert await run_worker(config, master) == 5
        assert await queue_is_drained(master, client.keys)
        copy = Redis.from_url(replica.url, decode_responses=True)
        try:
            for job_id in ids:  # the replica had each terminal state before its ack
                assert await copy.hget(client.keys.job(job_id), "status") == "succeeded"
        finally:
            await copy.aclose()
        await client.replication.aclose()
    finally:
        replica.stop()


async def test_the_gateway_answers_503_when_no_replica_confirms_a_new_job(
    own_redis: RedisServer, master: Redis, settings: Settings, mock_upstream: tuple[Any, str]
) -> None:
    config = waiting(settings, own_redis)
    async with (
        running_gateway(config, master, mock_upstream, worker=False) as gw,
        gw.http() as http,
    ):
        body = {**chat("no replica"), "stream": False}
        headers = {"idempotency-key": "once", "prefer": "respond-async"}
        response = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["code"] == "not_replicated" and "0 of 1 replicas" in error["message"]
    assert await master.xlen(gw.client.keys.queue) == 1  # queued on the master all the same
