"""Chaos on real Redis deployments: masters failing over while jobs stream.

Two ``chatstream worker`` processes (queue in 3 shards) run jobs that arrive steadily from
a producer that retries its enqueues (as real producers do: a failover refuses commands
for a few seconds, and with CHATSTREAM_REDIS_WAIT_REPLICAS an enqueue the replicas did not
confirm raises NotReplicatedError). Mid-run a master fails over:

- killed (SIGKILL), its replica promoted, on a 3+3 Cluster and on Sentinel;
- gracefully (CLUSTER FAILOVER): nothing is lost, so no job is rerun;
- after its replica was cut off from it for a while, so the promoted replica lacks every
  write acknowledged meanwhile: deltas, terminal writes, acks, queue entries and records.

Every job must end exactly once with the exact reply: one terminal entry, last; after the
last ``reset`` every entry belongs to the final attempt and the deltas merge into the
reply. Where writes are lost, jobs whose records fell behind are rerun (a ``reset``) even
with ``retry_after_output`` off: a rerun after Redis lost writes is a takeover, like one
after a crash. Where writes may be lost (a kill, a cut-off replica) the workers wait for
one replica (WAIT): without it a lost terminal write can leave a job ``running`` for good
(docs/reliability.md). The failed node is started again a second after the failover (as an
orchestrator would), so that the replica the workers wait for exists again: until then
enqueues raise NotReplicatedError and finished jobs keep their queue entries.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis.exceptions import RedisError

from schemas.events import EventType, StreamEvent
from schemas.jobs import JobRecord
from tests.helpers import deployments
from tests.helpers.checks import (
    after_last_reset,
    all_terminal,
    eventually,
    merge_deltas,
    queue_is_drained,
    stream_entries,
)
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK_PROCESS, chat
from tests.helpers.processes import mock_process
from worker.client import Client
from worker.errors import ChatstreamError
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient, connect
from worker.testing.mock_upstream import expected_reply

pytestmark = [
    pytest.mark.xdist_group("worker-processes"),
    pytest.mark.slow,
    pytest.mark.timeout(240),
]

JOBS = 60
SHARDS = 3
ARRIVALS_PER_SECOND = 10
WAIT = {"redis_wait_replicas": 1, "redis_wait_timeout_ms": 500}
RESTART_AFTER = 1.0  # seconds from the failover until the failed node is started again


def request(i: int) -> dict[str, Any]:
    return chat(f"job {i}", tokens=20 + (i * 37) % 41, rate=40, key=f"f{i}")  # 0.5-1.5 s


@dataclass
class Outcome:
    records: list[JobRecord]
    output: str
    seconds: float

    @property
    def attempts(self) -> dict[int, int]:
        return dict(Counter(record.attempt for record in self.records))

    @property
    def reruns(self) -> list[str]:
        return [record.id for record in self.records if record.attempt > 1]

    def report(self, name: str) -> str:
        seen = {line: self.output.count(line) for line in LOGGED}
        return (
            f"\n{name}: {len(self.records)} jobs in {self.seconds:.1f}s, attempts "
            f"{self.attempts}, rerun {self.reruns}; worker log lines {seen}"
        )


LOGGED = (
    "Redis lost writes",  # a running attempt's record fell behind: rerun
    "replicas acknowledged its terminal state",  # not acked yet: checked again later
    "took over",  # a worker judged dead while Redis did not answer
)


async def produce(client: Client, ids: list[str]) -> None:
    """Enqueue every job, retrying each until it is accepted (and replicated, if asked)."""
    for index, job_id in enumerate(ids):
        while True:
            try:
                await client.enqueue(request(index), job_id=job_id)
                break
            except (ChatstreamError, RedisError):  # a failover under way, or not replicated
                await asyncio.sleep(0.2)
        await asyncio.sleep(1 / ARRIVALS_PER_SECOND)


async def run_with_fault(
    url: str,
    prefix: str,
    tmp_path: Path,
    fault: Callable[[], object],
    **settings: Any,
) -> Outcome:
    """The jobs run while ``fault`` (blocking: a failover, and the failed node back) happens
    a third of the way in; every job ends, the queue drains."""
    config = Settings(_env_file=None, redis_url=url, prefix=prefix, queue_shards=SHARDS, **settings)
    redis = await connect(config)
    client = Client.from_settings(config, redis)  # waits for replicas as ``settings`` say
    ids = [f"fo-{i}" for i in range(JOBS)]
    began = time.monotonic()
    try:
        async with (
            mock_process(tmp_path) as upstream,
            Fleet.session(
                tmp_path, redis, url, prefix, upstream, shards=SHARDS, lease_seconds=5,
                concurrency=32, **settings,
            ) as fleet,
        ):  # fmt: skip
            keys = fleet.keys
            workers = await fleet.start(2)
            arriving = asyncio.create_task(produce(client, ids))
            await asyncio.sleep(JOBS / ARRIVALS_PER_SECOND / 3)
            await asyncio.to_thread(fault)
            await arriving
            await finish(redis, keys, ids, fleet)
            output = await fleet.stop(workers, 20)
        records = [
            await check(redis, keys, client, index, job_id) for index, job_id in enumerate(ids)
        ]
        return Outcome(records, output, time.monotonic() - began)
    finally:
        await client.aclose()


async def finish(
    redis: RedisClient,
    keys: Keys,
    ids: list[str],
    fleet: Fleet,
) -> None:
    try:
        await eventually(lambda: all_terminal(redis, keys, ids), 90, every=0.25)
        await eventually(lambda: drained(redis, keys), 60, every=0.25)
    except TimeoutError:
        raise AssertionError(f"jobs or queue unfinished\n{fleet.output()}") from None


async def drained(redis: RedisClient, keys: Keys) -> bool:
    try:
        return await queue_is_drained(redis, keys)
    except RedisError:
        return False


async def check(
    redis: RedisClient, keys: Keys, client: Client, index: int, job_id: str
) -> JobRecord:
    """Ended once with the exact reply, whatever Redis lost on the way."""
    record = await client.get(job_id)
    events = await stream_entries(redis, keys, job_id)
    assert record.status == "succeeded", (job_id, record.error, kinds(events))
    assert record.content == expected_reply(request(index), MOCK_PROCESS), job_id
    terminals = [event for event in events if event.terminal]
    assert len(terminals) == 1 and events[-1] is terminals[0], (job_id, kinds(events))
    assert terminals[0].type is EventType.DONE and terminals[0].attempt == record.attempt
    final = after_last_reset(events)
    assert {event.attempt for event in final} == {record.attempt}, (job_id, kinds(events))
    assert merge_deltas(final).content == record.content, job_id
    return record


def kinds(events: list[StreamEvent]) -> list[str]:
    return [f"{event.type.value}:{event.attempt}" for event in events]


# -- Redis Cluster ----------------------------------------------------------------------------


async def test_a_killed_cluster_master_fails_over_mid_run(prefix: str, tmp_path: Path) -> None:
    with deployments.cluster(masters=3, replicas=1) as cluster:
        victim = cluster.master_of_key(Keys(prefix, SHARDS).queue)

        def kill() -> None:
            cluster.kill(victim)
            cluster.wait_failover(victim)
            time.sleep(RESTART_AFTER)
            cluster.restart(victim)

        outcome = await run_with_fault(cluster.url, prefix, tmp_path, kill, **WAIT)
    print(outcome.report("cluster, master killed"))


async def test_a_graceful_cluster_failover_reruns_nothing(prefix: str, tmp_path: Path) -> None:
    with deployments.cluster(masters=3, replicas=1) as cluster:
        master = cluster.master_of_key(Keys(prefix, SHARDS).queue)
        replica = cluster.replica_of(master)
        outcome = await run_with_fault(
            cluster.url, prefix, tmp_path, lambda: cluster.failover(replica)
        )
    print(outcome.report("cluster, graceful failover"))
    assert "Redis lost writes" not in outcome.output, outcome.output
    assert outcome.attempts == {1: JOBS}  # nothing lost, nothing rerun


async def test_a_cluster_failover_losing_acknowledged_writes(prefix: str, tmp_path: Path) -> None:
    """The shard-0 master's replica is cut off for 3 s, then the master is killed and the
    lagging replica takes over: everything acknowledged in those 3 s on that master is gone."""
    with deployments.cluster(masters=3, replicas=1) as cluster:
        victim = cluster.master_of_key(Keys(prefix, SHARDS).queue)

        def lose_writes() -> None:
            cluster.cut_off_replica(victim)
            time.sleep(3)
            cluster.promote_lagging_replica(victim)
            time.sleep(RESTART_AFTER)
            cluster.restart(victim)

        outcome = await run_with_fault(cluster.url, prefix, tmp_path, lose_writes, **WAIT)
    print(outcome.report("cluster, acknowledged writes lost"))
    assert outcome.reruns  # jobs whose terminal writes were lost ran again


# -- Sentinel -----------------------------------------------------------------------------------


async def test_a_killed_sentinel_master_fails_over_mid_run(prefix: str, tmp_path: Path) -> None:
    with deployments.sentinels() as sentinels:

        def kill() -> None:
            sentinels.kill_master()
            sentinels.wait_failover()
            time.sleep(RESTART_AFTER)
            sentinels.rejoin()

        outcome = await run_with_fault(sentinels.url, prefix, tmp_path, kill, **WAIT)
    print(outcome.report("sentinel, master killed"))


async def test_a_sentinel_failover_losing_acknowledged_writes(prefix: str, tmp_path: Path) -> None:
    with deployments.sentinels() as sentinels:

        def lose_writes() -> None:
            sentinels.cut_off_replica()
            time.sleep(3)
            sentinels.promote_lagging_replica()
            time.sleep(RESTART_AFTER)
            sentinels.rejoin()

        outcome = await run_with_fault(sentinels.url, prefix, tmp_path, lose_writes, **WAIT)
    print(outcome.report("sentinel, acknowledged writes lost"))
    assert outcome.reruns  # jobs whose terminal writes were lost ran again
