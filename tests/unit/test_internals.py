"""worker.internals: every place chatstream reaches below a dependency's public API is found
on the releases it names, and where a release moved it, the code takes the public path and
says so in one line. Each test simulates one such change (no redis-server needed)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from packaging.version import Version
from redis.asyncio.cluster import ClusterPipeline, NodesManager, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, DefaultParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError

from worker import internals, speedups
from worker.aio import URGENT
from worker.embedded_server import EmbeddedServer, bind, served
from worker.service import ticks
from worker.settings import Settings
from worker.store import cluster_batch, redis_client


@pytest.fixture
def checks(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Checks made afresh (a simulated release), their lines captured."""
    internals.forget()
    caplog.set_level(logging.INFO, logger="chatstream.internals")
    yield caplog
    internals.forget()


def said(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    internal = internals.INTERNALS[name]
    return [r.getMessage() for r in caplog.records if internal.what in r.getMessage()]


def missing(caplog: pytest.LogCaptureFixture, name: str) -> None:
    """``name`` is reported missing, in exactly one line naming the release and fallback: a
    WARNING where the release should have it (it moved), INFO where it predates it."""
    assert not internals.available(name)
    assert not internals.available(name)  # checked once: said once
    internal = internals.INTERNALS[name]
    release = internals.installed(internal.distribution)
    assert release is not None
    assert said(caplog, name) == [
        f"{internal.distribution} {release}: {internal.what} not found; {internal.fallback}"
    ]
    [record] = [r for r in caplog.records if internal.what in r.getMessage()]
    moved = Version(release) >= Version(internal.since)
    assert record.levelno == (logging.WARNING if moved else logging.INFO)


@pytest.mark.parametrize("name", sorted(internals.INTERNALS))
def test_each_internal_is_found_on_the_releases_it_names(
    name: str, checks: pytest.LogCaptureFixture
) -> None:
    """On every release from ``since`` up (CI runs the newest and the lowest the package
    declares), the check passes: a release that moves one fails here, not in production."""
    internal = internals.INTERNALS[name]
    release = internals.installed(internal.distribution)
    if release is None:
        pytest.skip(f"{internal.distribution} is not installed")
    if Version(release) < Version(internal.since):
        pytest.skip(f"{internal.distribution} {release} predates {internal.since}")
    assert internals.available(name)
    assert said(checks, name) == []


def test_check_all_says_nothing_when_everything_is_found(checks: pytest.LogCaptureFixture) -> None:
    found = internals.check_all()  # (uvicorn is imported here: this module imports it)
    assert set(found) == {name for name in internals.INTERNALS if not name.startswith("otel-")}
    missing_here = [  # not found, and its dependency installed: each said once
        name
        for name, ok in found.items()
        if not ok and internals.installed(internals.INTERNALS[name].distribution)
    ]
    assert len(checks.records) == len(missing_here)


def test_redis_parsers_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    import redis._parsers

    monkeypatch.delattr(redis._parsers, "_AsyncRESP3Parser")
    assert speedups.parser_class(Settings(_env_file=None, redis_parser="python")) is DefaultParser
    missing(checks, "redis-parsers")


class _Closed(AbstractConnection):
    """A connection whose write fails as a closed uvloop transport's did."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        raise RuntimeError("the handler is closed")

    def _connection_arguments(self) -> Any:
        return {}

    async def _connect(self) -> None:
        pass

    def _host_error(self) -> str:
        return "nowhere"


def test_connection_writer_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    guarded = redis_client.guarded(_Closed)  # type: ignore[type-abstract]
    connection = guarded()
    with pytest.raises(RedisConnectionError, match="closed under a write"):
        asyncio.run(connection.send_packed_command(b"PING"))

    async def elsewhere(self: Connection) -> None:
        """A release that keeps its stream writer under another name."""

    internals.forget()
    monkeypatch.setattr(Connection, "_connect", elsewhere)
    with pytest.raises(RuntimeError, match="the handler is closed"):  # what redis-py raises
        asyncio.run(connection.send_packed_command(b"PING"))
    assert redis_client.connection_socket(connection) is None
    assert ticks.tick_seconds(Settings(_env_file=None, wake_tick_ms=12)) == 0  # no tick
    missing(checks, "redis-connection-writer")


def test_connect_hook_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    settings = Settings(_env_file=None, wake_tick_ms=12)
    assert ticks.tick_seconds(settings) == (0.012 if URGENT.possible() else 0)

    async def connects_otherwise(self: AbstractConnection, *args: Any, **kwargs: Any) -> None:
        await self.open_socket()  # type: ignore[attr-defined]  # a release's new name

    internals.forget()
    name = "connect_check_health" if hasattr(AbstractConnection, "connect_check_health") else ""
    monkeypatch.setattr(AbstractConnection, name or "connect", connects_otherwise)
    assert ticks.tick_seconds(settings) == 0  # our _connect would not be called: no tick
    missing(checks, "redis-connect-hook")


def test_determine_slot_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    monkeypatch.delattr(RedisCluster, "_determine_slot")
    missing(checks, "redis-determine-slot")  # redis-py routes the stream commands itself


def test_cluster_pipeline_constructor_changed(
    checks: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    cluster = redis_client.Cluster(host="127.0.0.1", port=1)
    assert type(cluster.pipeline()) is redis_client._Pipeline
    internals.forget()
    signature = inspect.signature(ClusterPipeline)
    first = next(iter(signature.parameters.values()))
    options = inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY)
    changed = signature.replace(parameters=[first, options])
    monkeypatch.setattr(ClusterPipeline, "__signature__", changed, raising=False)
    own: Any = object()
    monkeypatch.setattr(RedisCluster, "pipeline", lambda self, *a, **k: own)
    assert cluster.pipeline() is own
    missing(checks, "redis-cluster-pipeline")


def test_move_slot_not_a_coroutine(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    calls: list[str] = []

    class Nodes:
        def move_slot(self, error: Any) -> None:
            calls.append("move_slot")

        async def initialize(self) -> None:
            calls.append("initialize")

    class Fake:
        nodes_manager = Nodes()

    sender = cluster_batch.ClusterSender(Fake())  # type: ignore[arg-type]

    async def sent(commands: Any, indexes: Any, replies: list[Any]) -> None:
        for index in indexes:
            replies[index] = 1

    monkeypatch.setattr(sender, "_send_grouped", sent)
    monkeypatch.setattr(NodesManager, "move_slot", lambda self, error: None)  # synchronous
    replies: list[Any] = [MovedError("3999 127.0.0.1:6381")]
    asyncio.run(sender._follow_moved([("EVALSHA", "x", 1, "k")], replies))
    assert (calls, replies) == (["initialize"], [1])  # the map reloaded, the command resent
    missing(checks, "redis-move-slot")


def test_asyncio_loop_queues_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    base = asyncio.BaseEventLoop
    original = base.__init__

    def init(self: Any) -> None:  # a release that keeps its queues under other names
        original(self)

    async def look() -> tuple[Any, float]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, lambda: None)
        return ticks._queue_of(loop), ticks._next_timer_in(loop)

    queue, timer = asyncio.run(look())
    assert queue is not None and 0 < timer <= 0.5
    internals.forget()
    monkeypatch.setattr(base, "__init__", init)
    assert asyncio.run(look()) == (None, float("inf"))  # two quick passes, as on uvloop
    missing(checks, "asyncio-loop-queues")


def test_proxy_meter_provider_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import metrics
    from opentelemetry.metrics import _internal

    from worker import telemetry_sdk

    provider = _internal._ProxyMeterProvider()
    assert not telemetry_sdk._set(provider)  # the API's stand-in: ours may be installed
    internals.forget()
    monkeypatch.delattr(_internal, "_ProxyMeterProvider")
    assert not telemetry_sdk._set(metrics.NoOpMeterProvider())
    assert not telemetry_sdk._set(object())  # unknown: offered, kept only if the API takes it
    missing(checks, "otel-proxy-meter-provider")


def test_capture_signals_moved(checks: pytest.LogCaptureFixture, monkeypatch: Any) -> None:
    monkeypatch.delattr(uvicorn.Server, "capture_signals")
    EmbeddedServer(uvicorn.Config(lambda *a: None, log_config=None))
    missing(checks, "uvicorn-capture-signals")


async def test_uvicorn_server_internals_moved(
    checks: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """Without them an embedded server is uvicorn's own: it starts, answers and stops."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    original = uvicorn.Server.startup

    async def startup(self: uvicorn.Server, sockets: Any = None) -> None:  # a new release's
        await original(self, sockets)

    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    server = EmbeddedServer(uvicorn.Config(app, log_config=None, lifespan="off"))
    assert not server.own
    async with served(server, bind("127.0.0.1", 0)) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        writer.close()
    missing(checks, "uvicorn-server")


def test_uvicorn_protocol_internals_moved(
    checks: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from worker.gateway.connections import Connections, HeadTimeout, protocol_class

    assert issubclass(protocol_class(1.0, Connections(), implementation="h11"), HeadTimeout)
    internals.forget()
    monkeypatch.delattr(H11Protocol, "on_response_complete")
    assert protocol_class(1.0, Connections(), implementation="h11") is H11Protocol
    missing(checks, "uvicorn-protocols")
