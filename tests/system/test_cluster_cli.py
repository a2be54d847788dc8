"""The ``chatstream`` command on a real Redis Cluster (3 masters) and a real Sentinel set
(tests/helpers/deployments.py), as an operator runs it: ``CHATSTREAM_REDIS_URL`` and nothing else
(besides the key prefix, the mock upstream's URL and, on the cluster, 3 queue shards).

The cluster is reached by a plain ``redis://`` URL of one node and by ``redis+cluster://``,
the Sentinel set by ``redis+sentinel://``. Every URL carries a password (``default``
has none on these servers, and a ``nopass`` user accepts any): it must show up nowhere.

Each deployment is started once per module. The mock upstream is served by the test's
event loop, so every command runs as an asyncio subprocess; the worker runs in the
background with its log in a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.checks import eventually, queue_is_drained, stream_entries
from tests.helpers.deployments import Cluster, Sentinels
from tests.helpers.fakes import silent_server
from tests.helpers.harness import MOCK, chat
from tests.helpers.processes import clean_env, spawn_worker, stop_worker
from tests.helpers.servers import free_port
from tests.system.test_cli import DEADLINE, Result, assert_one_line_error, run_chatstream
from worker.client import Client
from worker.settings import Settings
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient, connect
from worker.testing.mock_upstream import MockUpstream, expected_reply

SHARDS = 3
SECRET = "s3cret"
AUTH = f"default:{SECRET}@"  # the nopass ``default`` user accepts any password
CORES = os.cpu_count() or 2
SLOW = {"tokens": 2000, "rate": 20}  # 100 s of reply: it runs until cancelled


@dataclass(frozen=True)
class Target:
    """A deployment as the operator names it: the URL, the shards, and what the worker's
    start-up line says after ``started: redis `` (a regular expression)."""

    url: str
    shards: int
    description: str


def node_url_target(cluster: Cluster) -> Target:
    address = cluster.masters[0].address
    node = re.escape(address)
    nodes = rf"(?:[\d.]+:\d+,)*{node}(?:,[\d.]+:\d+)*"  # the node, maybe the others too
    return Target(
        f"redis://{AUTH}{address}/0",
        SHARDS,
        rf"cluster default@{nodes} tls=off",
    )


def cluster_url_target(cluster: Cluster) -> Target:
    nodes = ",".join(node.address for node in cluster.masters)
    return Target(
        f"redis+cluster://{AUTH}{nodes}", SHARDS, re.escape(f"cluster default@{nodes} tls=off")
    )


def sentinel_target(deployment: Sentinels) -> Target:
    hosts = ",".join(node.address for node in deployment.sentinels)
    service = deployment.service
    description = f"sentinel default@{hosts} service={service}/0 tls=off"
    return Target(f"redis+sentinel://{AUTH}{hosts}/{service}/0", 1, re.escape(description))


@pytest.fixture(params=["cluster-node-url", "cluster-url", "sentinel-url"])
def target(request: pytest.FixtureRequest) -> Target:
    """The deployment's fixture is asked for only when a test needs it."""
    if request.param == "sentinel-url":
        return sentinel_target(request.getfixturevalue("sentinel_set"))
    cluster = request.getfixturevalue("cluster3")
    if request.param == "cluster-node-url":
        return node_url_target(cluster)
    return cluster_url_target(cluster)


def settings_of(target: Target, prefix: str) -> Settings:
    return Settings(_env_file=None, redis_url=target.url, prefix=prefix, queue_shards=target.shards)


@dataclass
class Operator:
    """Runs ``chatstream`` commands with one environment; keeps every result."""

    env: dict[str, str]
    cwd: Path
    results: list[Result] = field(default_factory=list)
    at_once: int = CORES

    def __post_init__(self) -> None:
        self.cores = asyncio.Semaphore(self.at_once)

    async def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 20
    ) -> Result:
        """One command to its end within ``timeout`` seconds of its start; at most
        ``at_once`` (one per core) run together: a deadline is one command's, not a queue's."""
        environment = {**self.env, **(env or {})}
        result = await run_chatstream(args, environment, self.cwd, self.cores, timeout)
        self.results.append(result)
        return result

    async def ok(self, *args: str) -> str:
        """A command that must succeed: its stdout."""
        result = await self.run(*args)
        assert result.returncode == 0, (args, result)
        assert "Traceback" not in result.stderr, (args, result.stderr)
        return result.stdout

    async def json_lines(self, *args: str) -> list[Any]:
        return [json.loads(line) for line in (await self.ok(*args, "--json")).splitlines()]


def operator_env(target: Target, prefix: str, upstream: str) -> dict[str, str]:
    env = {
        **clean_env(),
        "CHATSTREAM_REDIS_URL": target.url,
        "CHATSTREAM_PREFIX": prefix,
        "CHATSTREAM_UPSTREAM_URL": upstream,
    }
    if target.shards != 1:
        env["CHATSTREAM_QUEUE_SHARDS"] = str(target.shards)
    return env


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def heartbeat(self, redis: RedisClient, keys: Keys, timeout: float = 20) -> str:
        """Until the worker's heartbeat is in ``<prefix>:workers``; the worker's name."""
        marker = f"-{self.process.pid}-"
        names: list[str] = []

        async def beating() -> bool:
            assert self.process.poll() is None, self.output()
            beats: list[Any] = await redis.zrange(keys.workers, 0, -1)
            names[:] = [str(name) for name in beats if marker in str(name)]
            return bool(names)

        await eventually(beating, timeout, every=0.05)
        return names[0]

    async def stop(self) -> None:
        """SIGTERM: exit code 0 within 5 s, a clean log."""
        assert await stop_worker(self.process, timeout=5) == 0, self.output()
        output = self.output()
        assert "Traceback" not in output, output
        assert "shutting down gracefully" in output, output


@asynccontextmanager
async def background_worker(op: Operator) -> AsyncIterator[WorkerProcess]:
    """``chatstream worker`` in the background (killed if the test leaves it running)."""
    log_path = op.cwd / "worker.log"
    with log_path.open("wb") as log:
        process = spawn_worker(op.env, op.cwd, log)
    try:
        yield WorkerProcess(process, log_path)
    finally:
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait)


@asynccontextmanager
async def python_client(settings: Settings) -> AsyncIterator[Client]:
    """The test's own view of the deployment (what the commands' output is checked against)."""
    redis = await connect(settings)
    try:
        yield Client.from_settings(settings, redis)
    finally:
        await redis.aclose()


async def has_events(client: Client, job_id: str) -> bool:
    return int(await client.redis.xlen(client.keys.events(job_id))) > 0


async def has_dead_letters(client: Client) -> bool:
    return bool(await client.dead_letters())


async def inject_exhausted(client: Client, job_id: str) -> None:
    """A queued job already started 3 times (the default max_attempts): the worker fails it
    at once and dead-letters it (what a job crashing its workers three times comes to)."""
    record = {"id": job_id, "status": "queued", "attempt": "3", "request": json.dumps(chat())}
    assert await client.records.create(job_id, record) == "created"
    await client.records.mark_queued(job_id, await client.queue.add(job_id))


# -- the life of a worker and its jobs, through the command ---------------------------------


async def test_an_operator_runs_jobs_with_the_url_alone(
    target: Target, prefix: str, mock_upstream: tuple[MockUpstream, str], tmp_path: Path
) -> None:
    """Worker, enqueue (followed, failing, slow), cancel, status, tail, dead letters and
    their requeue, jobs, stats, SIGTERM: all with the URL alone, no password shown."""
    _, upstream = mock_upstream
    op = Operator(operator_env(target, prefix, upstream), tmp_path)
    exhausted = "exhausted-job"
    async with python_client(settings_of(target, prefix)) as client, background_worker(op) as w:
        name = await w.heartbeat(client.redis, client.keys)
        await inject_exhausted(client, exhausted)
        follow, failed, slow = await asyncio.gather(
            op.run("enqueue", "--model", "mock-model", "--message", "hi", "--follow"),
            op.run("enqueue", "--model", "mock-model", "--message", "bad", "--wait", "--json",
                   "--mock", json.dumps({"fault": "http_400"})),
            op.run("enqueue", "--model", "mock-model", "--message", "slow",
                   "--mock", json.dumps(SLOW)),
        )  # fmt: skip
        assert follow.returncode == 0, follow
        ok_id, printed = follow.stdout.split("\n", 1)
        assert printed.startswith(f"{expected_reply(chat('hi'), MOCK)}\n[done]\n"), printed
        assert f"job       {ok_id}\nstatus    succeeded\nattempt   1\n" in printed
        assert failed.returncode == 3, failed  # the job did not succeed
        failed_record = json.loads(failed.stdout)
        failed_id = failed_record["id"]
        assert (failed_record["status"], failed_record["error"]["status"]) == ("failed", 400)
        assert slow.returncode == 0, slow
        slow_id = slow.stdout.strip()
        await eventually(lambda: has_events(client, slow_id), 15)  # it streams
        await eventually(lambda: has_dead_letters(client), 15)

        async def dead_then_requeue() -> tuple[list[Any], str]:
            listed = await op.json_lines("dead")
            return listed, await op.ok("dead", "--requeue", exhausted)

        cancel, status, tail, (dead, requeued) = await asyncio.gather(
            op.ok("cancel", slow_id),
            op.ok("status", ok_id),
            op.json_lines("tail", ok_id, "--after", "0-0"),
            dead_then_requeue(),
        )
        assert cancel == "requested\n"  # it was running
        assert status.startswith(f"job       {ok_id}\nstatus    succeeded\nattempt   1\n"), status
        events = await stream_entries(client.redis, client.keys, ok_id)
        assert tail == [
            {"id": e.id, "type": e.type.value, "attempt": e.attempt, "data": e.data} for e in events
        ]
        assert tail[-1]["type"] == "done"
        assert [(d["job"], d["reason"]["code"]) for d in dead] == [
            (exhausted, "attempts_exhausted")
        ]
        assert requeued == "requeued\n"
        assert (await client.result(slow_id, timeout=15)).status == "cancelled"
        assert (await client.result(exhausted, timeout=15)).status == "succeeded"
        assert await client.dead_letters() == []  # a requeued job leaves the dead letters
        await eventually(lambda: queue_is_drained(client.redis, client.keys), 15)

        jobs, stats = await asyncio.gather(op.json_lines("jobs"), op.json_lines("stats"))
        ended = {ok_id: "succeeded", failed_id: "failed", slow_id: "cancelled"}
        created = {job_id: (await client.get(job_id)).created_at or 0.0 for job_id in ended}
        newest_first = sorted(ended, key=created.__getitem__, reverse=True)
        assert [(job["id"], job["status"]) for job in jobs] == [
            (exhausted, "succeeded"),  # requeued last: listed as of then
            *((job_id, ended[job_id]) for job_id in newest_first),
        ]
        [snapshot] = stats
        assert snapshot["live_workers"] == [name]
        counts = (snapshot["queue_length"], snapshot["pending"], snapshot["dead_letters"])
        assert counts == (0, 0, 0)

        await w.stop()
        assert await client.redis.zscore(client.keys.workers, name) is None  # it left the set
    for text in [w.output(), *(r.stdout + r.stderr for r in op.results)]:
        assert SECRET not in text
        assert "Traceback" not in text
    [line] = [line for line in w.output().splitlines() if f"worker {name} started: " in line]
    said = re.search(rf" started: redis (.*) prefix={prefix} ", line)
    assert said, line
    assert re.fullmatch(target.description, said[1]), line


# -- URLs that cannot work: one line, at once -------------------------------------------------

BAD_URLS = [
    ("redis+cluster://nohost", "CHATSTREAM_REDIS_URL: Value error, redis+cluster:// node 'nohost'"),
    ("redis+sentinel://127.0.0.1:1", "CHATSTREAM_REDIS_URL: Value error, redis+sentinel://host"),
]


async def test_a_malformed_url_is_one_line(tmp_path: Path) -> None:
    op = Operator(clean_env(), tmp_path)
    cases = [
        (url, fragment, command) for url, fragment in BAD_URLS for command in ("worker", "stats")
    ]
    results = await asyncio.gather(
        *(
            op.run(command, env={"CHATSTREAM_REDIS_URL": url}, timeout=DEADLINE)
            for url, _, command in cases
        )
    )
    for (url, fragment, command), result in zip(cases, results, strict=True):
        assert_one_line_error(result, f"invalid settings: {fragment}", (url, command))


async def test_a_deployment_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    """Closed ports, and a port that accepts and never answers: one line within 10 s, the
    URL named without its password."""

    def closed(n: int) -> str:
        return ",".join(f"127.0.0.1:{free_port()}" for _ in range(n))

    async with silent_server() as silent:
        cases = [
            (f"redis+cluster://{AUTH}127.0.0.1:{silent}", "stats", "no answer from Redis at"),
            (f"redis+sentinel://{AUTH}{closed(3)}/mymaster", "stats", "cannot reach Redis at"),
            (f"redis+sentinel://{AUTH}{closed(1)}/mymaster", "worker", "cannot reach Redis at"),
            (f"redis+cluster://{AUTH}{closed(3)}", "worker", "cannot reach Redis at"),
            (f"redis+cluster://{AUTH}{closed(2)}", "stats", "cannot reach Redis at"),
        ]
        # all at once: they wait on sockets (5 s for the silent port), not on the CPU
        op = Operator(clean_env(), tmp_path, at_once=len(cases))
        results = await asyncio.gather(
            *(
                op.run(command, env={"CHATSTREAM_REDIS_URL": url}, timeout=DEADLINE)
                for url, command, _ in cases
            )
        )
    for (url, command, fragment), result in zip(cases, results, strict=True):
        shown = url.replace(SECRET, "***")
        assert SECRET not in result.stderr
        assert_one_line_error(result, f"{fragment} {shown}", (url, command))
        assert "<redis." not in result.stderr, result.stderr  # no repr of redis-py objects


async def test_a_wrong_sentinel_service_is_one_line(
    sentinel_set: Sentinels, prefix: str, tmp_path: Path
) -> None:
    hosts = ",".join(node.address for node in sentinel_set.sentinels)
    url = f"redis+sentinel://{AUTH}{hosts}/nosuch"
    op = Operator(
        {**clean_env(), "CHATSTREAM_PREFIX": prefix, "CHATSTREAM_REDIS_URL": url}, tmp_path
    )
    result = await op.run("worker", timeout=DEADLINE)
    shown = url.replace(SECRET, "***")
    assert_one_line_error(result, f"cannot reach Redis at {shown}: No master found for 'nosuch'")
    assert SECRET not in result.stderr
