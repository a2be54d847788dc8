"""Waiting for replicas: Redis ``WAIT`` after the writes that must outlive a failover.

Redis replicates asynchronously: a master acknowledges a write before any replica has it,
and a failover to a replica that lacked it loses it. With ``CHATSTREAM_REDIS_WAIT_REPLICAS``
= n > 0, an enqueue returns, and a job's queue entry is acked, only once n replicas have the
record's state (``WAIT n CHATSTREAM_REDIS_WAIT_TIMEOUT_MS`` on the connection that made the
last write; the replication stream is ordered, so it covers every earlier write to that
master too). What that does and does not guarantee is in docs/reliability.md.

The writes and their ``WAIT`` go on pooled connections (a pool per master on a Cluster),
never on the publisher's, so a replica that is slow or gone delays only the writes that
wait for it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, MovedError, RedisClusterException, RedisError

from worker.errors import NotReplicatedError
from worker.store import lua
from worker.store.batch import Command
from worker.store.records import as_text
from worker.store.redis_client import RedisClient, slot_of

CHECK_TERMINAL = lua.script("replication/check_terminal")
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class Replication:
    def __init__(self, redis: RedisClient, replicas: int, timeout_ms: int) -> None:
        self.redis = redis
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._nodes: dict[tuple[str, int], Redis] = {}  # a Cluster's masters, by address

    @property
    def enabled(self) -> bool:
        return self.replicas > 0

    async def send(self, key: str, command: Command) -> tuple[Any, int]:
        """``command`` and then ``WAIT`` on one connection to ``key``'s master: its reply
        (raised when Redis refused it) and how many replicas have it. Calls at the same time
        use connections of their own (pooled)."""
        pipe = (await self._client_of(key)).pipeline(transaction=False)
        pipe.execute_command(*command)
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
        try:
            reply, acked = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError):
            await self._reload_slots()
            raise
        if isinstance(reply, MovedError | ClusterDownError):
            await self._reload_slots()
        for result in (reply, acked):
            if isinstance(result, Exception):
                raise result
        return reply, int(acked)

    async def _client_of(self, key: str) -> Redis:
        """The client itself (one server, Sentinel), or a pooled client of the master that
        serves ``key`` on a Cluster (WAIT has no key: it must go where the writes went)."""
        if isinstance(self.redis, Redis):
            return self.redis
        await self.redis.initialize()
        node: ClusterNode = self.redis.nodes_manager.get_node_from_slot(slot_of(key))
        address = (node.host, int(node.port))
        if address not in self._nodes:
            pool = ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            self._nodes[address] = Redis.from_pool(pool)
        return self._nodes[address]

    async def _reload_slots(self) -> None:
        if isinstance(self.redis, RedisCluster):
            with contextlib.suppress(RedisError, RedisClusterException):
                await self.redis.nodes_manager.initialize()

    def enough(self, acked: int) -> bool:
        return acked >= self.replicas

    async def write(self, key: str, command: Command, what: str) -> Any:
        """One write, acknowledged by enough replicas (else NotReplicatedError)."""
        reply, acked = await self.send(key, command)
        if not self.enough(acked):
            raise NotReplicatedError(self.shortfall(what, acked))
        return reply

    async def terminal_replicated(self, record_key: str) -> bool:
        """The record is terminal and enough replicas have that (a write and a WAIT)."""
        check: Command = ("EVAL", CHECK_TERMINAL, 1, record_key, f"{time.time():.6f}")
        status, acked = await self.send(record_key, check)
        return as_text(status) in TERMINAL and self.enough(acked)

    def shortfall(self, what: str, acked: int) -> str:
        return (
            f"{what}: {acked} of {self.replicas} replicas acknowledged it within "
            f"{self.timeout_ms} ms (CHATSTREAM_REDIS_WAIT_REPLICAS); the master has it, but a "
            "failover now could lose it"
        )

    async def aclose(self) -> None:
        nodes, self._nodes = list(self._nodes.values()), {}
        for client in nodes:
            await client.aclose()
