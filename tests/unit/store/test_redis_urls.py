"""CHATSTREAM_REDIS_URL's forms (one server, Cluster, Sentinel), the queue's shard keys and
the clients' connection classes: parsing and naming without a server, and one write on a
closed connection (the deployments are in test_cluster.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS
from redis.exceptions import ConnectionError as RedisConnectionError

from tests.helpers.servers import RedisServer, free_port, needs_redis_server
from worker.errors import ConfigError
from worker.service.runtime import startup_summary
from worker.settings import Settings, load_settings
from worker.store.keys import Keys
from worker.store.redis_client import (
    SPARE_CONNECTIONS,
    BlockingSentinelPool,
    ShedsIdleConnections,
    guarded,
    redis_from_settings,
    slot_of,
)
from worker.urls import parse_redis_url


def test_one_server_urls_are_kept_as_they_are() -> None:
    for url in ("redis://h:1/2", "rediss://u:p@h:1/0?ssl_cert_reqs=none", "unix:///tmp/r.sock"):
        parsed = parse_redis_url(url)
        assert (parsed.kind, parsed.url) == ("single", url)
    assert parse_redis_url("rediss://h:1/0").tls


def test_cluster_urls_list_their_nodes_and_keep_auth_and_options() -> None:
    parsed = parse_redis_url(
        "rediss+cluster://u:p%40ss@a:7000,b:7001,[::1]:7002/0?ssl_cert_reqs=none"
    )
    assert parsed.kind == "cluster" and parsed.tls
    assert parsed.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert parsed.url == "rediss://u:p%40ss@a:7000/0?ssl_cert_reqs=none"
    assert parse_redis_url("redis+cluster://a:1").url == "redis://a:1/0"


def test_sentinel_urls_name_the_service_and_db_and_the_sentinels_own_user() -> None:
    parsed = parse_redis_url(
        "redis+sentinel://u:pw@s1:26379,s2:26380/mymaster/3?sentinel_password=spw&socket_timeout=2"
    )
    assert (parsed.kind, parsed.service, parsed.nodes) == (
        "sentinel",
        "mymaster",
        (("s1", 26379), ("s2", 26380)),
    )
    assert parsed.url == "redis://u:pw@s1:26379/3?socket_timeout=2"
    assert parsed.sentinel_options == (("sentinel_password", "spw"),)
    assert parse_redis_url("redis+sentinel://s:1/svc").url == "redis://s:1/0"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:1/0", "must start with"),
        ("redis+cluster://", "at least one host:port"),
        ("redis+cluster://a", "is not host:port"),
        ("redis+cluster://a:x", "is not host:port"),
        ("redis+cluster://a:1/2", "database 0 only"),
        ("redis+sentinel://s:1", "<service>"),
        ("redis+sentinel://s:1/svc/db", "<service>"),
        ("unix+cluster:///x", "not a socket"),
        ("redis+shard://h:1", "must start with"),
    ],
)
def test_a_bad_url_is_one_clear_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_redis_url(url)
    with pytest.raises(ConfigError) as raised:
        load_settings(_env_file=None, redis_url=url)
    assert "CHATSTREAM_REDIS_URL" in str(raised.value) and says in str(raised.value)


async def test_each_form_builds_its_kind_of_client_without_connecting() -> None:
    def client(url: str) -> Redis | RedisCluster:
        return redis_from_settings(Settings(_env_file=None, redis_url=url))

    one = client("redis://127.0.0.1:1/4")
    assert isinstance(one, Redis) and one.connection_pool.connection_kwargs["db"] == 4
    cluster = client("rediss+cluster://u:p@127.0.0.1:1,127.0.0.1:2?ssl_cert_reqs=none")
    assert isinstance(cluster, RedisCluster)
    assert [node.port for node in cluster.startup_nodes] == [1, 2]
    node = cluster.startup_nodes[0]
    assert issubclass(node.connection_class, SSLConnection)  # (and ClosedTransportGuard)
    assert (node.connection_kwargs["username"], node.connection_kwargs["password"]) == ("u", "p")
    sentinel = client("redis+sentinel://127.0.0.1:1/mymaster/2?sentinel_password=s")
    assert isinstance(sentinel, Redis)
    pool = sentinel.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    assert pool.connection_kwargs["db"] == 2
    manager = pool.sentinel_manager
    assert manager.sentinel_kwargs["password"] == "s"  # the sentinels' own, not the master's
    assert "password" not in pool.connection_kwargs or pool.connection_kwargs["password"] is None
    for redis in (one, cluster, sentinel):
        await redis.aclose()


async def test_the_startup_line_names_the_deployment_without_passwords() -> None:
    settings = Settings(_env_file=None, redis_url="rediss+sentinel://u:secret@s:1,t:2/svc/1")
    message, fields = startup_summary(settings, Redis(), "w")
    assert fields["redis"] == "sentinel u@s:1,t:2 service=svc/1 tls=on"
    assert "secret" not in message


def test_one_shard_keeps_the_single_queue_key() -> None:
    keys = Keys("p")
    assert keys.queues == ("p:queue",) and keys.queue_shard(0) == "p:queue"
    assert {keys.shard_of(f"job-{i}") for i in range(100)} == {0}
    assert keys.jobs_shard(0) == "p:jobs"


@pytest.mark.parametrize("shards", [2, 3, 4, 7, 16, 256])
@pytest.mark.parametrize("prefix", ["chatstream", "t-3f9a0c1d2e4b", "acme:prod"])
def test_each_shard_sits_in_its_own_share_of_the_slots(prefix: str, shards: int) -> None:
    keys = Keys(prefix, shards)
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    shares = [int(slot_of(key) // width) for key in keys.queues]
    assert sorted(shares) == list(range(shards)), shares
    for shard in range(1, shards):  # shard 0's index is <p>:jobs, as with one shard
        assert slot_of(keys.jobs_shard(shard)) == slot_of(keys.queue_shard(shard))
    assert Keys(prefix, shards).queues == keys.queues  # the same names every time


def test_three_shards_land_on_three_masters_of_a_default_cluster() -> None:
    """``redis-cli --cluster create`` with 3 masters: 0-5460, 5461-10922, 10923-16383."""
    ranges = [(0, 5460), (5461, 10922), (10923, 16383)]
    for prefix in ("chatstream", "t-1", "acme:prod", *(f"t-{n:012x}" for n in range(200))):
        masters = {
            next(i for i, (low, high) in enumerate(ranges) if low <= slot_of(key) <= high)
            for key in Keys(prefix, 3).queues
        }
        assert masters == {0, 1, 2}, prefix


def test_enqueue_spreads_jobs_over_the_shards() -> None:
    keys = Keys("p", 4)
    counts = [0] * 4
    for i in range(4000):
        counts[keys.shard_of(f"{i:032x}")] += 1
    assert min(counts) > 900, counts


class _UncheckedWrite(Connection):
    """A connection that writes as redis-py before 8.2 did: no look at the transport first."""

    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        assert self._writer is not None
        self._writer.writelines(command)
        await self._writer.drain()


async def _write_after_reset(
    url: str, writes_as: type[Connection] | None = None
) -> BaseException | None:
    """A PING written on a connection whose transport was reset: what the write raised.
    The connection is a chatstream client's as configured, or ``writes_as`` guarded."""
    redis = redis_from_settings(Settings(_env_file=None, redis_url=url))
    assert isinstance(redis, Redis)
    pool = redis.connection_pool
    connection_class = pool.connection_class if writes_as is None else guarded(writes_as)
    connection = connection_class(**pool.connection_kwargs)
    try:
        await connection.connect()  # type: ignore[no-untyped-call]
        connection._writer.transport.abort()  # type: ignore[union-attr]  # the peer's reset
        await asyncio.sleep(0.01)
        await connection.send_packed_command(b"*1\r\n$4\r\nPING\r\n")
    except BaseException as exc:
        return exc
    finally:
        await connection.disconnect()
        await redis.aclose()
    return None


def _on_uvloop(write: Coroutine[Any, Any, BaseException | None]) -> BaseException | None:
    """``write`` on uvloop, whose closed transport raised what the guard turns into a
    ConnectionError (skipped without the fast extra)."""
    try:
        import uvloop
    except ImportError:
        write.close()
        pytest.skip("needs uvloop (the fast extra)")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(write)


def test_a_write_on_a_connection_the_peer_closed_is_a_connection_error(
    redis_server: RedisServer | None,
) -> None:
    """With the installed redis-py, a chatstream client's write on a transport the peer
    reset raises ConnectionError (which every retry covers), under uvloop."""
    server = needs_redis_server(redis_server)
    raised = _on_uvloop(_write_after_reset(server.url))
    assert isinstance(raised, RedisConnectionError), repr(raised)


def test_the_guard_turns_the_transports_own_error_into_a_connection_error(
    redis_server: RedisServer | None,
) -> None:
    """Under uvloop, redis-py before 8.2 leaked RuntimeError ("the handler is closed") for
    a write on a transport the peer closed (redis-py#4287); ClosedTransportGuard raises
    ConnectionError instead. Without the guard the same write is not a RedisError."""
    server = needs_redis_server(redis_server)
    raised = _on_uvloop(_write_after_reset(server.url, _UncheckedWrite))
    assert isinstance(raised, RedisConnectionError), repr(raised)
    assert "closed under a write (RuntimeError)" in str(raised)
    assert isinstance(raised.__cause__, RuntimeError)


async def test_the_pool_closes_what_a_burst_opened_once_nothing_needs_it(
    redis_server: RedisServer | None,
) -> None:
    """A burst of 40 commands at once opens 40 connections; a shed after a quiet while
    closes the idle ones (the pub/sub connection, lent meanwhile, stays open and works), the
    next commands connect again, and up to SPARE_CONNECTIONS idle ones are kept."""
    server = needs_redis_server(redis_server)
    client = redis_from_settings(Settings(_env_file=None, redis_url=server.url))
    assert isinstance(client, Redis)
    pool = client.connection_pool
    assert isinstance(pool, ShedsIdleConnections)
    assert issubclass(BlockingSentinelPool, ShedsIdleConnections)

    async def burst(n: int) -> None:
        await asyncio.gather(*[client.blpop(["nothing"], timeout=0.1) for _ in range(n)])

    try:
        await burst(40)
        assert pool.open_connections == 40
        async with client.pubsub() as pubsub:
            await pubsub.subscribe("a-channel")
            assert await pool.shed_idle() == 0  # the busiest moment since the start needed 40
            assert await pool.shed_idle() == 39  # nothing needed them since
            assert pool.open_connections == 1  # the subscription's, lent all along
            await client.publish("a-channel", "still here")
            messages = [await pubsub.get_message(timeout=2) for _ in range(2)]
            assert [m["data"] for m in messages if m] == [1, "still here"]  # subscribed, then it
        await burst(SPARE_CONNECTIONS)
        assert [await pool.shed_idle() for _ in range(2)] == [0, 0]
        assert pool.open_connections == SPARE_CONNECTIONS
    finally:
        await client.aclose()


async def test_a_connection_that_failed_to_connect_is_not_counted_as_given_back() -> None:
    """redis-py releases a connection it could not connect without having lent it: the
    count of lent connections stays right (it went below zero, and the pool would then
    have closed its idle connections every round)."""
    client = redis_from_settings(
        Settings(_env_file=None, redis_url=f"redis://127.0.0.1:{free_port()}/0")
    )
    assert isinstance(client, Redis)
    client.set_retry(Retry(NoBackoff(), 0))
    pool = client.connection_pool
    assert isinstance(pool, ShedsIdleConnections)
    for _ in range(3):
        with pytest.raises(RedisConnectionError):
            await client.ping()
    assert pool._lent == set() and pool._busiest == 0
    await client.aclose()
