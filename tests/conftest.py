"""Shared fixtures: a real redis-server on a free loopback port, started here; the
in-process worker (``harness``); the Redis servers and deployments several test modules use
(a password, TLS, Cluster, Sentinel). What the fixtures are made of is in ``tests/helpers/``.

Every test gets its own key prefix, so tests never read or flush data they did not
create. Without ``redis-server`` on the PATH the Redis fixtures fall back to fakeredis
with a visible warning in the report header; under CI (``CI=true``) that is an error.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from redis.asyncio import Redis

from tests.helpers.browser import launched_browser
from tests.helpers.fleet import Fleet
from tests.helpers.harness import MOCK, Harness
from tests.helpers.servers import (
    REDIS_PASSWORD,
    AuthRedisServer,
    RedisServer,
    auth_server,
    needs_redis_server,
    redis_executable,
)
from tests.helpers.tls import TLSRedisServer, TLSSetup, make_certs
from worker.client import Client
from worker.service.worker import Worker
from worker.settings import Settings
from worker.store.redis_client import RedisClient, redis_from_settings
from worker.testing.mock_upstream import MockConfig, MockUpstream, serve_mock

if TYPE_CHECKING:
    from playwright.async_api import Browser

    from tests.helpers.deployments import Cluster, Sentinels


def pytest_configure(config: pytest.Config) -> None:
    interruptible_children()


def interruptible_children() -> None:
    """The commands the tests Ctrl-C must see it. A shell without job control (a CI script's
    ``&``, ``nohup``) starts its background jobs with SIGINT ignored; an ignored signal is
    inherited through ``exec``, and Python keeps it ignored (``asyncio.Runner`` then installs
    no handler), as a background job should. So under such a runner every CLI process the
    tests start ignored their SIGINT, and its Ctrl-C tests waited for a process that never
    heard it. The test processes take Python's default handler back, which ``exec`` resets
    to the default action in their children."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_report_header() -> str:
    if redis_executable():
        return "redis: a real redis-server per test session"
    return "WARNING redis: redis-server not found; Redis tests fall back to fakeredis"


@pytest.fixture
def urgent_set() -> Iterator[None]:
    """``worker.aio.URGENT`` started, as a worker whose tick is on starts it."""
    from worker.aio import URGENT

    if not URGENT.start():
        pytest.skip("no epoll on this platform: no set of urgent sockets")
    yield
    URGENT.stop()


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


@pytest.fixture
async def mock_upstream() -> AsyncIterator[tuple[MockUpstream, str]]:
    app = MockUpstream(MOCK)
    async with serve_mock(app=app) as url:
        yield app, url


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """A headless Chromium (skipped without one, except under CI)."""
    async with launched_browser() as launched:
        yield launched


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


@pytest.fixture
async def fleet(
    redis_server: RedisServer | None,
    redis: RedisClient,
    prefix: str,
    mock_upstream: tuple[MockUpstream, str],
    tmp_path: Path,
) -> AsyncIterator[Fleet]:
    """``chatstream worker`` subprocesses on the session's redis-server, the test's prefix and
    the mock upstream (tests/helpers/fleet.py); any still running at the end are killed."""
    server = needs_redis_server(redis_server)
    mock, url = mock_upstream
    async with Fleet.session(tmp_path, redis, server.url, prefix, url, mock=mock) as workers:
        yield workers


@pytest.fixture(scope="module")
def cluster3() -> Iterator[Cluster]:
    """A 3-master Redis Cluster (tests/helpers/deployments.py), one per test module."""
    from tests.helpers import deployments

    with deployments.cluster(masters=3) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def sentinel_set() -> Iterator[Sentinels]:
    """1 master, 1 replica, 3 Sentinels (tests/helpers/deployments.py), one per test module."""
    from tests.helpers import deployments

    with deployments.sentinels() as deployment:
        yield deployment


@pytest.fixture(scope="module")
def password_server() -> Iterator[AuthRedisServer]:
    """A redis-server that requires a password, one per test module."""
    with auth_server(f":{REDIS_PASSWORD}", "--requirepass", REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TLSRedisServer]:
    """A redis-server on a TLS port only, with a password (tests/helpers/tls.py), one per
    test module."""
    executable = redis_executable()
    if executable is None:
        pytest.skip("needs redis-server")
    with tempfile.TemporaryDirectory(prefix="chatstream-tls-") as directory:
        server = TLSRedisServer(executable, Path(directory), make_certs(Path(directory)))
        try:
            server.start()
        except Exception as exc:  # a redis-server built without TLS
            server.stop()
            pytest.skip(f"redis-server without TLS support: {exc}")
        yield server
        server.stop()


@pytest.fixture
async def tls(tls_server: TLSRedisServer, settings: Settings) -> AsyncIterator[TLSSetup]:
    """A started in-process worker and a client on the TLS server, and their mock upstream."""
    app = MockUpstream(MockConfig(tokens=8))
    async with serve_mock(app=app) as url:
        config = settings.model_copy(update={"redis_url": tls_server.url, "upstream_url": url})
        redis = redis_from_settings(config)
        assert isinstance(redis, Redis)
        worker = Worker(config, redis)
        await worker.startup()
        try:
            yield TLSSetup(
                tls_server, config, redis, worker, Client.from_settings(config, redis), app
            )
        finally:
            await worker.shutdown()
            await redis.aclose()
