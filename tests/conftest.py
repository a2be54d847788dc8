"""Shared fixtures: a real redis-server on a free loopback port, started here.

Every test gets its own key prefix, so tests never read or flush data they did not
create. Without ``redis-server`` on the PATH the Redis fixtures fall back to fakeredis
with a visible warning in the report header; under CI (``CI=true``) that is an error.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis as sync_redis
from redis.asyncio import Redis

from schemas.events import StreamEvent
from schemas.jobs import JobRecord
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient
from worker.testing.mock_upstream import MockConfig, MockUpstream, serve_mock

if TYPE_CHECKING:
    from tests.deployments import Cluster, Sentinels


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A redis-server subprocess owned by the test session (restartable for outage tests)."""

    def __init__(self, executable: str, directory: Path, *extra: str) -> None:
        self.executable = executable
        self.directory = directory
        self.extra = extra
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [
            self.executable,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.directory),
            "--protected-mode",
            "no",
            *self.extra,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        self.wait_ready()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        client = sync_redis.Redis.from_url(self.url)
        try:
            while True:
                try:
                    client.ping()
                    return
                except sync_redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: without persistence, everything it held is gone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def redis_executable() -> str | None:
    return shutil.which("redis-server")


def pytest_report_header() -> str:
    if redis_executable():
        return "redis: a real redis-server per test session"
    return "WARNING redis: redis-server not found; Redis tests fall back to fakeredis"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | None]:
    executable = redis_executable()
    if executable is None:
        if os.environ.get("CI"):
            pytest.fail("CI requires redis-server on the PATH")
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="chatstream-redis-") as directory:
        server = RedisServer(executable, Path(directory))
        server.start()
        yield server
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, without persistence: its memory limit, its data
    and its life are the test's to change (kill it, start an empty one on its port)."""
    executable = redis_executable()
    if executable is None:
        pytest.skip("needs a real redis-server")
    directory = tmp_path / "own-redis"
    directory.mkdir()
    server = RedisServer(executable, directory)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def redis(redis_server: RedisServer | None) -> AsyncIterator[Redis]:
    if redis_server is None:
        import fakeredis

        client: Redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    else:
        client = Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def settings(redis_server: RedisServer | None, prefix: str) -> Settings:
    return Settings(
        _env_file=None,
        redis_url=redis_server.url if redis_server else "redis://127.0.0.1:1/0",
        prefix=prefix,
        upstream_url="http://127.0.0.1:9/v1",
        concurrency=64,
        lease_seconds=5,
        block_ms=50,
        retry_attempts=4,  # a bounded budget: the default waits out an outage (test_outage.py)
        retry_initial_backoff=0.01,
        retry_max_backoff=0.05,
        connect_timeout=2,
        first_byte_timeout=5,
        idle_timeout=5,
        shutdown_grace_seconds=5,
    )


@dataclass
class Harness:
    """A started in-process worker, a client, and the mock upstream they talk to."""

    settings: Settings
    redis: RedisClient
    mock: MockUpstream
    worker: Worker
    client: Client

    async def run(self, request: dict[str, Any], **kwargs: Any) -> JobRecord:
        """Enqueue one job, run the worker until the queue is empty, return the record."""
        job_id = await self.client.enqueue(request, **kwargs)
        await self.worker.run_burst()
        return await self.client.get(job_id)

    async def events(self, job_id: str) -> list[StreamEvent]:
        return [event async for event in self.client.events(job_id, block_ms=100)]


def chat(text: str = "hello", **mock: Any) -> dict[str, Any]:
    """A chat request for the mock upstream; ``mock`` options steer its behaviour."""
    message = {"role": "user", "content": text}
    request: dict[str, Any] = {"model": "mock-model", "messages": [message]}
    if mock:
        request["mock"] = mock
    return request


MOCK = MockConfig(tokens=12)  # the mock_upstream fixture's server config


@pytest.fixture
async def mock_upstream() -> AsyncIterator[tuple[MockUpstream, str]]:
    app = MockUpstream(MOCK)
    async with serve_mock(app=app) as url:
        yield app, url


@pytest.fixture
async def harness(
    settings: Settings, redis: RedisClient, mock_upstream: tuple[MockUpstream, str]
) -> AsyncIterator[Harness]:
    app, url = mock_upstream
    settings = settings.model_copy(update={"upstream_url": url})
    worker = Worker(settings, redis)
    await worker.startup()
    yield Harness(settings, redis, app, worker, Client.from_settings(settings, redis))
    await worker.shutdown()


@pytest.fixture(scope="module")
def cluster3() -> Iterator[Cluster]:
    """A 3-master Redis Cluster (tests/deployments.py), one per test module."""
    from tests import deployments  # (which imports this module)

    with deployments.cluster(masters=3) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[Sentinels]:
    """1 master, 1 replica, 3 Sentinels (tests/deployments.py), one per test module."""
    from tests import deployments

    with deployments.sentinels() as deployment:
        yield deployment
