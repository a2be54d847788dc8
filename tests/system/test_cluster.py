"""chatstream on real Redis deployments (tests/helpers/deployments.py): a 3-master Redis Cluster
and Sentinel (1 master, 1 replica, 3 sentinels), in one process with the mock upstream.

A cross-slot command fails on a real cluster (CROSSSLOT), so running every step of a job's
life here (enqueue, start, deltas, terminal write, cancel, requeue, takeover, stats, the
jobs index, the gateway's reads) shows each touches one slot. The publisher's per-master
round trips and its following of MOVED and ASK are checked against a live slot migration.
Failovers are in test_failover.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from schemas.jobs import JobStatus
from tests.helpers.checks import check_stream, eventually, queue_is_drained, stream_entries
from tests.helpers.deployments import Cluster, Node, Sentinels
from tests.helpers.gateway_env import chunks_of, content_of, running_gateway, sse_events
from tests.helpers.harness import MOCK, Harness, chat, spread
from worker.aio import cancel_and_wait
from worker.client import Client
from worker.dashboard import serve_dashboard
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.batch import ConnectionSender
from worker.store.cluster_batch import ClusterSender
from worker.store.queue import Queue
from worker.store.redis_client import connect, slot_of
from worker.store.stats import collect
from worker.testing.mock_upstream import MockUpstream, expected_reply

SHARDS = 3


async def harness_on(
    url: str, settings: Settings, mock: tuple[MockUpstream, str], **updates: Any
) -> Harness:
    app, upstream = mock
    config = settings.model_copy(
        update={"redis_url": url, "upstream_url": upstream, "queue_shards": SHARDS, **updates}
    )
    redis = await connect(config)
    worker = Worker(config, redis)
    await worker.startup()
    return Harness(config, redis, app, worker, Client.from_settings(config, redis))


@pytest.fixture
async def on_cluster(
    cluster3: Cluster, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[Harness]:
    h = await harness_on(cluster3.url, settings, mock_upstream)  # a plain URL of one node
    yield h
    await h.worker.shutdown()
    await h.redis.aclose()


@pytest.fixture
async def on_sentinel(
    sentinel_set: Sentinels, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[Harness]:
    h = await harness_on(sentinel_set.url, settings, mock_upstream)
    yield h
    await h.worker.shutdown()
    await h.redis.aclose()


def command(node: Node, *args: Any) -> Any:
    """One command on one node (redis-py's sync client)."""
    return node.client.execute_command(*args)  # type: ignore[no-untyped-call]


def masters_of(cluster: Cluster, keys: list[str]) -> set[int]:
    return {cluster.master_of_key(key).port for key in keys}


def requests(n: int) -> list[dict[str, Any]]:
    kinds = [{}, {"tool_calls": 2}, {"reasoning": 3}, {"chunk_tokens": 3}]
    return [chat(f"job {i}", tokens=6, **kinds[i % len(kinds)]) for i in range(n)]


async def run_all(h: Harness, batch: list[dict[str, Any]]) -> list[str]:
    ids = [await h.client.enqueue(request) for request in batch]
    assert await h.worker.run_burst() == len(batch)
    for request, job_id in zip(batch, ids, strict=True):
        record = await h.client.get(job_id)
        assert record.status is JobStatus.SUCCEEDED, record.error
        assert record.content == expected_reply(request, MOCK)
        check_stream(await stream_entries(h.redis, h.worker.keys, job_id), record)
    return ids


# -- connecting -------------------------------------------------------------------------------


async def test_any_nodes_plain_url_and_the_cluster_url_give_a_cluster_client(
    cluster3: Cluster, settings: Settings
) -> None:
    urls = [f"redis://127.0.0.1:{node.port}/0" for node in cluster3.masters]
    for url in [*urls, cluster3.cluster_url]:
        redis = await connect(settings.model_copy(update={"redis_url": url}))
        try:
            assert isinstance(redis, RedisCluster), url
            assert len(redis.get_primaries()) == 3
            assert await redis.ping()
        finally:
            await redis.aclose()


async def test_a_sentinel_url_reaches_the_master(
    sentinel_set: Sentinels, settings: Settings
) -> None:
    redis = await connect(settings.model_copy(update={"redis_url": sentinel_set.url}))
    try:
        assert isinstance(redis, Redis)
        info: Any = await redis.info("replication")
        assert info["role"] == "master"
        assert int((await redis.info("server"))["tcp_port"]) == sentinel_set.master.port
    finally:
        await redis.aclose()


# -- jobs on a cluster --------------------------------------------------------------------------


async def test_jobs_run_end_to_end_on_a_cluster_across_every_master(
    on_cluster: Harness, cluster3: Cluster
) -> None:
    h = on_cluster
    assert isinstance(h.worker.publisher._sender, ClusterSender)
    keys = h.worker.keys
    assert masters_of(cluster3, list(keys.queues)) == {node.port for node in cluster3.masters}
    ids = await run_all(h, requests(24))
    assert masters_of(cluster3, [keys.job(job_id) for job_id in ids]) == {
        node.port for node in cluster3.masters
    }
    assert await queue_is_drained(h.redis, keys)
    stats = await collect(h.redis, keys, live_window=30)
    assert (stats.queue_length, stats.pending, stats.live_workers) == (0, 0, [h.worker.name])
    listed = await h.client.jobs(limit=100)
    assert sorted(job.id for job in listed.jobs) == sorted(ids)


async def test_cancel_requeue_and_progress_on_a_cluster(on_cluster: Harness) -> None:
    h = on_cluster
    consume = asyncio.create_task(h.worker.consume())
    try:
        slow = await h.client.enqueue(chat("slow", tokens=200, rate=20))
        await eventually(lambda: running(h, slow))
        progress = await h.client.progress(slow)
        assert progress is not None and progress.attempt == 1
        assert await h.client.cancel(slow) == "requested"  # the worker hears it (pub/sub)
        record = await h.client.result(slow, timeout=10)
        assert record.status is JobStatus.CANCELLED
        failed = await h.client.enqueue(chat("fails", fault="http_400"))
        assert (await h.client.result(failed, timeout=10)).status is JobStatus.FAILED
        assert await h.client.requeue(failed) == "requeued"  # its shard, its slot
        assert (await h.client.result(failed, timeout=10)).status is JobStatus.FAILED
    finally:
        h.worker.stopping.set()
        await cancel_and_wait([consume])
    for job_id in (slow, failed):
        check_stream(
            await stream_entries(h.redis, h.worker.keys, job_id), await h.client.get(job_id)
        )


async def running(h: Harness, job_id: str) -> bool:
    return (await h.client.get(job_id)).status is JobStatus.RUNNING


async def test_a_dead_workers_jobs_are_taken_over_on_every_shard(on_cluster: Harness) -> None:
    h = on_cluster
    dead = Queue(h.redis, h.worker.keys, "dead-worker")
    ids = [
        await h.client.enqueue(chat("orphan", tokens=2), job_id=i) for i in spread(h.worker.keys)
    ]
    held = [entry for _ in range(SHARDS) for entry in await dead.read(9, None)]
    assert {entry.shard for entry in held} == set(range(SHARDS))
    taken, emptied = await h.worker.queue.take_over("dead-worker", 100)
    assert emptied and len(taken) == 9
    for entry in taken:
        h.worker.launch(entry)
    await eventually(lambda: queue_is_drained(h.redis, h.worker.keys))
    assert {(await h.client.get(job_id)).status for job_id in ids} == {JobStatus.SUCCEEDED}


# -- the publisher's round trips on a cluster ----------------------------------------------------


def key_on_each_master(cluster: Cluster, prefix: str) -> list[str]:
    found: dict[int, str] = {}
    for i in itertools.count():
        key = f"{prefix}:{{k{i}}}"
        found.setdefault(cluster.master_of_key(key).port, key)
        if len(found) == len(cluster.masters):
            return list(found.values())
    raise AssertionError("unreachable")


async def test_a_batch_is_one_write_per_master_with_replies_in_order(
    cluster3: Cluster, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = await connect(settings.model_copy(update={"redis_url": cluster3.cluster_url}))
    assert isinstance(redis, RedisCluster)
    writes: list[int] = []
    send = ConnectionSender.send

    async def counted(self: ConnectionSender, commands: list[Any]) -> list[Any]:
        writes.append(len(commands))
        return await send(self, commands)

    monkeypatch.setattr(ConnectionSender, "send", counted)
    sender = ClusterSender(redis)
    keys = key_on_each_master(cluster3, settings.prefix)
    commands: list[tuple[Any, ...]] = [("INCRBY", keys[i % 3], i) for i in range(30)]
    commands.insert(7, ("EVAL", "return redis.error_reply('OOM refused')", 1, keys[1]))
    try:
        replies = await sender.send(commands)
    finally:
        await sender.aclose()
        await redis.aclose()
    assert sorted(writes) == [10, 10, 11]  # one packed write per master
    assert type(replies[7]).__name__ == "OutOfMemoryError"  # a refusal is its reply
    numbers = [reply for index, reply in enumerate(replies) if index != 7]
    running_sums = [sum(range(k, i + 1, 3)) for i in range(30) for k in [i % 3]]
    assert numbers == running_sums


async def test_moved_and_ask_are_followed_during_a_slot_migration(
    cluster3: Cluster, settings: Settings
) -> None:
    redis = await connect(settings.model_copy(update={"redis_url": cluster3.cluster_url}))
    assert isinstance(redis, RedisCluster)
    sender = ClusterSender(redis)
    key = f"{settings.prefix}:{{migrating}}"
    slot = slot_of(key)
    source = cluster3.master_of_slot(slot)
    target = next(node for node in cluster3.masters if node is not source)
    source_id = command(source, "CLUSTER MYID")
    target_id = command(target, "CLUSTER MYID")
    try:
        command(target, "CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        command(source, "CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        # the key is not on the source: it answers ASK, and the sender asks the target
        assert await sender.send([("SET", key, "asked")]) == [b"OK"]
        for node in cluster3.masters:
            command(node, "CLUSTER SETSLOT", slot, "NODE", target_id)
        await eventually(lambda: agreed(cluster3, slot, target.port))
        # the sender's slot map still names the source: it answers MOVED
        assert await sender.send([("GET", key), ("APPEND", key, "!")]) == [b"asked", 6]
        assert target.client.get(key) == "asked!"
    finally:
        for node in cluster3.masters:  # the slot back where it was, the key gone
            command(node, "CLUSTER SETSLOT", slot, "NODE", target_id)
        target.client.delete(key)
        for node in cluster3.masters:
            command(node, "CLUSTER SETSLOT", slot, "NODE", source_id)
        await sender.aclose()
        await redis.aclose()


async def agreed(cluster: Cluster, slot: int, port: int) -> bool:
    for node in cluster.masters:
        for low, high, *rest in command(node, "CLUSTER SLOTS"):
            if low <= slot <= high and rest[0][1] != port:
                return False
    return True


# -- the gateway on a cluster ---------------------------------------------------------------------


async def test_the_dashboard_reads_a_cluster_and_acts_on_it(on_cluster: Harness) -> None:
    """The dashboard's reads (pipelined over the masters, a script per shard), a job's reply
    through the hub's per-job readers, and its actions (a pause on every shard, a cancel)."""
    h = on_cluster
    settings = h.settings.model_copy(update={"dashboard_keys": SecretStr("sk-ops")})
    consume = asyncio.create_task(h.worker.consume())
    headers = {"x-chatstream-dashboard-key": "sk-ops"}
    try:
        async with (
            serve_dashboard(settings, h.redis, host="127.0.0.1", port=0) as url,
            httpx.AsyncClient(base_url=url, headers=headers, timeout=20) as http,
        ):
            slow = await h.client.enqueue(chat("slow", tokens=400, rate=40), tenant="a")
            await eventually(lambda: running(h, slow))
            assert (await http.post("/api/upstreams/default/pause")).json()["changed"]
            held = [await h.client.enqueue(chat(), tenant="b", job_id=job_id)
                    for job_id in spread(h.worker.keys, per_shard=1)]  # fmt: skip
            overview = (await http.get("/api/overview")).json()
            reply = ""
            async with http.stream("GET", f"/api/jobs/{slow}/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        reply += json.loads(line[6:])["data"].get("content", "")
                    if len(reply) > 30:
                        break
            assert (await http.post(f"/api/jobs/{slow}/cancel")).json()["status"] == "requested"
            assert (await http.post("/api/upstreams/default/resume")).json()["changed"]
            for job_id in [slow, *held]:
                await h.client.result(job_id, timeout=10)
    finally:
        h.worker.stopping.set()
        await cancel_and_wait([consume])
    totals = overview["totals"]
    assert (totals["running"], totals["waiting"]) == (1, SHARDS)
    assert [shard["waiting"] for shard in overview["shards"]] == [1] * SHARDS
    assert overview["upstreams"][0]["paused_shards"] == SHARDS
    assert reply.startswith("tok0 tok1")
    assert (await h.client.get(slow)).status is JobStatus.CANCELLED


async def test_the_gateway_streams_and_resumes_jobs_on_a_cluster(
    cluster3: Cluster, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> None:
    await stream_through_gateway(cluster3.url, settings, mock_upstream)


async def test_the_gateway_streams_and_resumes_jobs_through_sentinel(
    sentinel_set: Sentinels, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> None:
    await stream_through_gateway(sentinel_set.url, settings, mock_upstream)


async def stream_through_gateway(
    url: str, settings: Settings, mock_upstream: tuple[MockUpstream, str]
) -> None:
    """A reply streamed, cut off after 5 events and resumed; 3 more clients replay it."""
    config = settings.model_copy(update={"redis_url": url, "queue_shards": SHARDS})
    redis = await connect(config)
    request = chat("through the gateway", tokens=30, rate=100.0)
    body = {**request, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with running_gateway(config, redis, mock_upstream) as gw, gw.http() as http:
            first: list[Any] = []
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                job_id = response.headers["x-chatstream-job-id"]
                async for event in sse_events(response):
                    first.append(event)
                    if len(first) == 5:
                        break
            headers = {"last-event-id": first[-1].id}
            async with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
                rest = [event async for event in sse_events(r)]
            others = await asyncio.gather(*(replay(http, job_id) for _ in range(3)))
    finally:
        await redis.aclose()
    events = first + rest
    assert content_of(chunks_of(events)) == expected_reply(request, MOCK)
    assert rest[-1].data == "[DONE]"
    assert all(content_of(chunks_of(seen)) == expected_reply(request, MOCK) for seen in others)


async def replay(http: httpx.AsyncClient, job_id: str) -> list[Any]:
    async with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        return [event async for event in sse_events(response)]


# -- Sentinel -------------------------------------------------------------------------------


async def test_jobs_run_through_sentinel(on_sentinel: Harness, sentinel_set: Sentinels) -> None:
    h = on_sentinel
    assert isinstance(h.worker.publisher._sender, ConnectionSender)  # issue 11's sender
    ids = await run_all(h, requests(12))
    stored = sentinel_set.master.client.hget(h.worker.keys.job(ids[0]), "status")
    assert stored == "succeeded"  # on the master the Sentinels name
    await eventually(lambda: replicated(sentinel_set, h.worker.keys.job(ids[-1])))


async def test_the_dashboard_reads_through_sentinel(on_sentinel: Harness) -> None:
    """The dashboard on the master the Sentinels name: its overview, and a job's reply
    replayed through the hub."""
    h = on_sentinel
    settings = h.settings.model_copy(update={"dashboard_keys": SecretStr("sk-ops")})
    [done] = await run_all(h, requests(1))
    failed = await h.client.enqueue(chat("no", fault="http_400"), tenant="b")
    await h.worker.run_burst()
    headers = {"x-chatstream-dashboard-key": "sk-ops"}
    async with (
        serve_dashboard(settings, h.redis, host="127.0.0.1", port=0) as url,
        httpx.AsyncClient(base_url=url, headers=headers, timeout=20) as http,
    ):
        await h.worker.upkeep.flush_activity()
        overview = (await http.get("/api/overview")).json()
        replay = (await http.get(f"/api/jobs/{done}/events")).text
        listed = (await http.get("/api/jobs", params={"status": "failed"})).json()["jobs"]
    assert overview["totals"]["finished_last_hour"] == 2
    assert overview["totals"]["failed_last_hour"] == 1
    assert [row["name"] for row in overview["workers"]] == [h.worker.name]
    assert '"type":"done"' in replay and [job["id"] for job in listed] == [failed]


async def replicated(deployment: Sentinels, key: str) -> bool:
    return deployment.replica.client.hget(key, "status") == "succeeded"


async def test_stream_reads_are_routed_without_asking_a_node(
    cluster3: Cluster, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XREADGROUP / XREAD keys come from their STREAMS arguments, XGROUP's and XINFO's from
    theirs: no COMMAND GETKEYS round
    trip to a node that may be the one failing over (a closed connection there once raised
    RuntimeError out of a worker's queue read)."""
    redis = await connect(settings.model_copy(update={"redis_url": cluster3.cluster_url}))
    assert isinstance(redis, RedisCluster)

    async def no_getkeys(*args: Any) -> Any:
        raise AssertionError(f"COMMAND GETKEYS for {args}")

    monkeypatch.setattr(redis.commands_parser, "_get_moveable_keys", no_getkeys)
    key = f"{settings.prefix}:{{routed}}:stream"
    try:
        await redis.xgroup_create(key, "g", id="0", mkstream=True)
        await redis.xadd(key, {"f": "v"})
        assert await redis.xreadgroup("g", "c", {key: ">"}, count=1, block=10)
        assert await redis.xread({key: "0-0"}, count=1)
        assert [group["name"] for group in await redis.xinfo_groups(key)] == ["g"]
        assert await redis.xgroup_delconsumer(key, "g", "c") == 1  # its one unacked entry
    finally:
        await redis.delete(key)
        await redis.aclose()
