"""Connecting to Redis from ``CHATSTREAM_REDIS_URL``: one server, a Cluster, or Sentinel.

The URL forms (docs/configuration.md):

- ``redis://`` / ``rediss://`` (TLS) / ``unix://``: one server. :func:`connect` asks it
  ``INFO cluster`` once: a node of a Redis Cluster is used as the cluster's first node, so a
  plain URL of any cluster node works with no other setting.
- ``redis+cluster://host:port[,host:port...]`` (``rediss+cluster://``): a Redis Cluster,
  discovered from any of those nodes.
- ``redis+sentinel://host:port[,host:port...]/<service>[/<db>]`` (``rediss+sentinel://``):
  the master of ``<service>`` as the Sentinels name it, followed across failovers.

User, password and query options (``ssl_ca_certs``, ``ssl_cert_reqs``, ...) are redis-py's
and apply to the data nodes. For Sentinel, TLS applies to the Sentinels too, and the query
options ``sentinel_username`` / ``sentinel_password`` are the Sentinels' own ACL user.

Every client has the same options (one place, :func:`redis_from_settings`): replies decoded
(bytes that are not UTF-8 become U+FFFD), connection errors and timeouts retried with the
backoff of ``worker.retry``, the socket timeout above the longest blocking read.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import Any, TypeAlias, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    parse_url,
)
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    MasterNotFoundError,
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker import internals, speedups
from worker.aio import URGENT, HasFileno, mixed_in, socket_of
from worker.errors import RedisUnavailableError
from worker.retry import RedisBackoff
from worker.settings import Settings
from worker.urls import RedisUrl, parse_redis_url, redacted_url

RedisClient: TypeAlias = Redis | RedisCluster
SPARE_CONNECTIONS = 4  # open beyond a round's busiest moment before the idle ones are closed


class ClusterUnavailableError(RedisConnectionError):
    """No master serves a key's slot, or no node of the cluster answers (a failover under
    way): redis-py raises these as ``RedisClusterException``, which is no ``RedisError``."""


class Cluster(RedisCluster):
    """redis-py's cluster client, its ``RedisClusterException`` raised as
    :class:`ClusterUnavailableError` so that every retry of a Redis failure applies."""

    async def initialize(self, *args: Any, **kwargs: Any) -> Cluster:
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailableError(str(exc)) from exc
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailableError(str(exc)) from exc

    async def _determine_slot(self, command: str, *args: Any) -> int:
        """The slot of ``XREAD`` / ``XREADGROUP`` (their ``STREAMS`` keys) and of ``XGROUP`` /
        ``XINFO`` subcommands (their key), here: redis-py asks a node (``COMMAND GETKEYS``)
        for those, a round trip per call,
        and during a failover that node may be the dead one (its closed connection then
        raised ``RuntimeError`` out of the worker's queue read)."""
        name = command.upper()
        if name.startswith(("XGROUP ", "XINFO ")) and args:  # (subcommand) key ...
            return slot_of(args[0].decode() if isinstance(args[0], bytes) else str(args[0]))
        if name in ("XREAD", "XREADGROUP"):
            words = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
            at = next(i for i, word in enumerate(words) if word.upper() == "STREAMS")
            keys = words[at + 1 : at + 1 + (len(words) - at - 1) // 2]
            slots = {slot_of(key) for key in keys}
            if len(slots) != 1:
                raise RedisClusterException(f"{command} keys in {len(slots)} slots: {keys}")
            return slots.pop()
        slot: int = await super()._determine_slot(command, *args)
        return slot

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if not internals.available("redis-cluster-pipeline"):
            return super().pipeline(transaction, shard_hint)
        return _Pipeline(self, transaction)  # type: ignore[abstract]


class _Pipeline(ClusterPipeline):
    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return await super().execute(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailableError(str(exc)) from exc


class ClosedTransportGuard(AbstractConnection):
    """A write on a connection whose peer just closed it raises ``ConnectionError``.

    redis-py before 8.2 leaks the transport's own error there instead: ``RuntimeError``
    ("the handler is closed") under uvloop, ``TypeError`` or ``AttributeError`` on some
    CPythons (redis-py#4287, uvloop#506). None is a ``RedisError``, so no retry applied and
    a failover crashed a worker's queue read or a Sentinel reconnect. Which it was is told
    by the transport's state, not by the message. (redis-py 8.2 looks at the transport
    before it writes; the guard keeps the older releases ``redis>=5.0`` admits covered.)

    Its socket is one of ``URGENT``'s: a reply ends a wake-up tick's sleep at once (the
    publisher's connection leaves the set but while something waits for its reply:
    ``ConnectionSender.expedite``)."""

    async def _connect(self) -> None:
        with URGENT.hurry():
            await super()._connect()  # type: ignore[safe-super, no-untyped-call]
        _CONNECTED.add(self)
        URGENT.watch(connection_socket(self))  # (nothing unless a worker started the set)

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (RuntimeError, TypeError, AttributeError) as exc:
            if not internals.available("redis-connection-writer") or not _transport_closed(self):
                raise
            await self.disconnect(nowait=True)
            raise RedisConnectionError(
                f"the connection was closed under a write ({type(exc).__name__})"
            ) from exc


_CONNECTED: weakref.WeakSet[AbstractConnection] = weakref.WeakSet()


def watch_connected() -> None:
    """The guarded connections made before a worker started ``URGENT`` join it now (the
    worker's first PING, a test's client)."""
    for connection in list(_CONNECTED):
        if connection.is_connected:
            URGENT.watch(connection_socket(connection))


def _transport(connection: AbstractConnection) -> Any:
    """The asyncio (or uvloop) transport under a redis-py connection (None: not connected,
    or redis-py keeps it elsewhere now: ``worker.internals``)."""
    if not internals.available("redis-connection-writer"):
        return None
    return getattr(getattr(connection, "_writer", None), "transport", None)


def _transport_closed(connection: AbstractConnection) -> bool:
    transport = _transport(connection)
    return transport is None or bool(transport.is_closing())


def connection_socket(connection: AbstractConnection) -> HasFileno | None:
    return socket_of(_transport(connection))


def guarded(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """``connection_class`` with :class:`ClosedTransportGuard` in front (one class each)."""
    return mixed_in(ClosedTransportGuard, connection_class, "Guarded")


class ShedsIdleConnections(ConnectionPool):
    """A pool that gives back what a burst opened: :meth:`shed_idle` closes the idle
    connections when more are open than the busiest moment since its last call needed.

    redis-py's pools keep every connection they ever opened (up to ``max_connections``):
    one burst of job starts (a read of hundreds of entries, a takeover) left a worker with
    128 open connections to Redis for the rest of its life (docs/decisions.md, 75). This
    counts the connections lent (``get_connection`` / ``release``) and closes the idle ones
    with the public ``disconnect(inuse_connections=False)``; a closed connection stays in
    the pool and connects again when it is next used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # lent now; a set, as redis-py also releases a connection it could not connect
        self._lent: set[AbstractConnection] = set()
        self._busiest = 0  # the most lent at once since the last shed_idle
        self._made: weakref.WeakSet[AbstractConnection] = weakref.WeakSet()

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        connection: AbstractConnection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        self._made.add(connection)
        self._lent.add(connection)
        self._busiest = max(self._busiest, len(self._lent))
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        self._lent.discard(connection)
        await super().release(connection)

    @property
    def open_connections(self) -> int:
        return sum(1 for connection in self._made if connection.is_connected)

    async def shed_idle(self, spare: int = SPARE_CONNECTIONS) -> int:
        """Close the idle connections if more than ``spare`` beyond the busiest moment since
        the last call are open; how many were closed."""
        opened, needed = self.open_connections, self._busiest
        self._busiest = len(self._lent)
        if opened <= needed + spare:
            return 0
        await self.disconnect(inuse_connections=False)
        return opened - self.open_connections


class SheddingPool(ShedsIdleConnections, BlockingConnectionPool):
    """The one-server pool: waits for a free connection, sheds idle ones."""


async def shed_idle_connections(redis: RedisClient) -> int:
    """``ShedsIdleConnections.shed_idle`` on the client's pool (0 for a cluster client:
    its nodes' pools are redis-py's own)."""
    pool = getattr(redis, "connection_pool", None)
    return await pool.shed_idle() if isinstance(pool, ShedsIdleConnections) else 0


# a job step waits this long for a free pooled connection before it counts as a Redis error
POOL_WAIT_SECONDS = 30
REDIS_RETRIES = 10
SENTINEL_SOCKET_TIMEOUT = 2.0
# the first PING of a command-line tool or worker: no retries, an answer within this long
REACH_SECONDS = 5.0


def client_options(settings: Settings) -> dict[str, Any]:
    """What every chatstream Redis client runs with, whatever the deployment."""
    return {
        "decode_responses": True,
        "encoding_errors": "replace",
        "health_check_interval": 30,
        "socket_connect_timeout": 5,
        "socket_timeout": settings.block_ms / 1000 + 10,
        "socket_keepalive": True,
        "retry": Retry(RedisBackoff(), REDIS_RETRIES),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


def redis_from_settings(settings: Settings) -> RedisClient:
    """The client workers, clients and the gateway use (no I/O here).

    One server: a blocking pool of ``redis_max_connections`` (hundreds of jobs starting at
    once wait briefly for a connection instead of failing), replies parsed by hiredis when
    installed (``CHATSTREAM_REDIS_PARSER``). A Cluster: redis-py's cluster client, up to
    ``redis_max_connections`` per node. Sentinel: the master of the service, a blocking pool.
    A plain URL of a cluster node gives a one-server client here; :func:`connect` detects it.
    """
    parsed = parse_redis_url(settings.redis_url)
    if parsed.kind == "cluster":
        return cluster_client(parsed, settings)
    if parsed.kind == "sentinel":
        return sentinel_client(parsed, settings)
    pool = SheddingPool.from_url(
        parsed.url,
        connection_class=guarded(parse_url(parsed.url).get("connection_class", Connection)),
        max_connections=settings.redis_max_connections,
        timeout=POOL_WAIT_SECONDS,
        parser_class=speedups.parser_class(settings),
        **client_options(settings),
    )
    return Redis.from_pool(pool)


def cluster_client(parsed: RedisUrl, settings: Settings) -> Cluster:
    options = {**parse_url(parsed.url), **client_options(settings)}
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    options.pop("db", None)
    options.pop("host", None)
    options.pop("port", None)
    options.pop("retry_on_error", None)  # the cluster retries these itself, re-routing
    nodes = [ClusterNode(host, port) for host, port in parsed.nodes]
    cluster = Cluster(
        startup_nodes=nodes, max_connections=settings.redis_max_connections, **options
    )
    connection_class = guarded(cluster.connection_kwargs["connection_class"])
    cluster.connection_kwargs["connection_class"] = connection_class  # the nodes found later
    for node in cluster.startup_nodes:
        node.connection_class = cast("type[Connection]", connection_class)
    return cluster


class BlockingSentinelPool(ShedsIdleConnections, SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinel-managed pool, waiting for a free connection and shedding idle ones like
    the one-server pool."""


class SentinelMaster(Redis):
    """The master a Sentinel names; closing it also closes the connections to the Sentinels."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        pool = self.connection_pool
        await super().aclose(close_connection_pool)
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()


def sentinel_client(parsed: RedisUrl, settings: Settings) -> Redis:
    options = {**parse_url(parsed.url), **client_options(settings)}
    for name in ("host", "port"):
        options.pop(name, None)
    tls: dict[str, Any] = {}
    managed: type[AbstractConnection] = SentinelManagedConnection
    if options.pop("connection_class", None) is SSLConnection:
        tls = {k: v for k, v in options.items() if k.startswith("ssl")}
        managed = SentinelManagedSSLConnection
    own = dict(parsed.sentinel_options)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_SOCKET_TIMEOUT,
        "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),  # the next Sentinel is asked; the master's retry waits
        "decode_responses": True,
        **({"ssl": True, **tls} if tls or parsed.tls else {}),
        **{name.removeprefix("sentinel_"): value for name, value in own.items()},
    }
    sentinel = Sentinel(list(parsed.nodes), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call, unused-ignore]  # typed in redis-py 8.2
    master: Redis = sentinel.master_for(
        parsed.service,
        redis_class=SentinelMaster,
        connection_pool_class=BlockingSentinelPool,
        connection_class=guarded(managed),
        max_connections=settings.redis_max_connections,
        timeout=POOL_WAIT_SECONDS,
        parser_class=speedups.parser_class(settings),
        **options,
    )
    return master


async def connect(settings: Settings) -> RedisClient:
    """:func:`redis_from_settings` once Redis answered a PING (within seconds, else
    RedisUnavailableError), a one-server URL of a Cluster node turned into a cluster client
    (one ``INFO cluster``), and a cluster client's slot map loaded."""
    parsed = parse_redis_url(settings.redis_url)
    redis = redis_from_settings(settings)
    try:
        await ensure_reachable(redis, redacted_url(settings.redis_url))
        if parsed.kind == "single" and isinstance(redis, Redis) and await _cluster_enabled(redis):
            await redis.aclose()
            cluster = RedisUrl("cluster", parsed.url, _node_of(redis))
            redis = cluster_client(cluster, settings)
        if isinstance(redis, RedisCluster):
            await redis.initialize()
    except BaseException:
        await redis.aclose()
        raise
    return redis


async def _cluster_enabled(redis: Redis) -> bool:
    if "path" in redis.connection_pool.connection_kwargs or is_fake(redis):
        return False
    try:
        info: Any = await redis.info("cluster")
    except (RedisError, OSError):
        return False  # not answering: the caller's reachability check says so
    return bool(int(info.get("cluster_enabled", 0)))


def _node_of(redis: Redis) -> tuple[tuple[str, int], ...]:
    kwargs = redis.connection_pool.connection_kwargs
    return ((str(kwargs.get("host", "localhost")), int(kwargs.get("port", 6379))),)


def is_fake(redis: RedisClient) -> bool:
    """An in-process stand-in (fakeredis), not a connection to a server."""
    if isinstance(redis, RedisCluster):
        return False
    pool = redis.connection_pool
    return type(pool).__module__.startswith("fakeredis") or "fakeredis" in str(
        getattr(pool, "connection_class", "")
    )


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (its ``{hash tag}`` when it has one)."""
    return int(key_slot(key.encode()))


def _reason(exc: BaseException) -> str:
    """The error's message; for Sentinel's, without redis-py's repr of every Sentinel."""
    if isinstance(exc, MasterNotFoundError):
        found = str(exc).split(" : ")[0]
        return f"{found} (no Sentinel answered with one: unreachable, or no such service)"
    return str(exc) or type(exc).__name__


async def ensure_reachable(redis: RedisClient, where: str, timeout: float = REACH_SECONDS) -> None:
    """One PING, not retried, answered within ``timeout``, or RedisUnavailableError.

    A command-line tool (or a worker starting) should say at once that Redis is down or
    that something else listens on the port, rather than ride out a restart for seconds
    (which the client's retries do for every later command). A cluster client's own
    retries are bounded by ``timeout`` alone.
    """
    retry = None if isinstance(redis, RedisCluster) else redis.get_retry()
    if retry is not None and isinstance(redis, Redis):
        redis.set_retry(Retry(NoBackoff(), 0))
    try:
        async with asyncio.timeout(timeout):
            await redis.ping()
    except TimeoutError:
        raise RedisUnavailableError(
            f"no answer from Redis at {where} within {timeout:g}s (is it a Redis server?)"
        ) from None
    except (RedisError, RedisClusterException, OSError) as exc:
        raise RedisUnavailableError(f"cannot reach Redis at {where}: {_reason(exc)}") from None
    finally:
        if retry is not None and isinstance(redis, Redis):
            redis.set_retry(retry)


def stream_replies(reply: Any) -> list[tuple[Any, Any]]:
    """An XREAD / XREADGROUP reply as (key, entries) pairs (RESP2 gives a list, RESP3 a dict)."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else [(k, r) for k, r in reply]
