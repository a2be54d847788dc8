"""The publisher's round trip on a Redis Cluster: one packed write per master, at once.

A batch is split by the master that serves each command's key slot (from redis-py's
cluster client's slot map); every master's share goes out as one packed write on a
connection of this sender's own (:class:`worker.store.batch.ConnectionSender`), all masters
concurrently, and the replies are put back in the batch's order. The contract is the one
of ``worker.store.batch``: one reply per command; a refused command's reply is its exception.
Here a master that cannot be reached, or answers late, refuses *its* commands (each gets
the error as its reply) without failing the others' share, so the publisher resends only
those, in order, on the job's next round trip.

Redirections are followed in the same call: ``MOVED`` updates the slot map and sends the
command once more to the new owner; ``ASK`` (a slot being migrated) sends it to the
importing node after ``ASKING``. A command still refused after that (``TRYAGAIN``, a master
failing over) comes back as its error; a lost connection or ``CLUSTERDOWN`` also makes the
next call reload the slot map first (at most every ``REFRESH_EVERY`` seconds). Every write
the publisher sends is fenced and numbered (``worker.store.records``), so sending one twice, or
to a master that lost it in a failover, cannot duplicate or reorder an entry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
)

from worker import internals
from worker.store.batch import BatchSender, Command, ConnectionSender, PipelineSender
from worker.store.redis_client import RedisClient, is_fake, slot_of

log = logging.getLogger("chatstream.publisher")

REFRESH_EVERY = 0.25  # seconds: the least time between two reloads of the slot map
Node = tuple[str, int]


def routing_key(command: Command) -> str:
    """The key a command's slot comes from: a script's first key, else its first argument."""
    if str(command[0]).upper() in ("EVAL", "EVALSHA"):
        return str(command[3])
    return str(command[1])


class ClusterSender:
    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        self._senders: dict[Node, ConnectionSender] = {}
        self._stale_map = False
        self._refreshed_at = 0.0
        self._expedited = False

    async def send(self, commands: list[Command]) -> list[Any]:
        await self._refresh_if_stale()
        replies: list[Any] = [None] * len(commands)
        await self._send_grouped(commands, range(len(commands)), replies)
        await self._follow_moved(commands, replies)
        await self._follow_ask(commands, replies)
        return replies

    async def aclose(self) -> None:
        senders, self._senders = list(self._senders.values()), {}
        await asyncio.gather(*(sender.aclose() for sender in senders), return_exceptions=True)

    def expedite(self, on: bool) -> None:
        self._expedited = on
        for sender in self._senders.values():
            sender.expedite(on)

    async def _send_grouped(
        self, commands: list[Command], indexes: Iterable[int], replies: list[Any]
    ) -> None:
        groups: dict[Node, list[int]] = {}
        for index in indexes:
            try:
                node = self._node_of(routing_key(commands[index]))
            except (RedisError, RedisClusterException) as exc:  # no master serves the slot
                replies[index] = exc
                self._stale_map = True
                continue
            groups.setdefault(node, []).append(index)
        await asyncio.gather(
            *(self._send_node(node, group, commands, replies) for node, group in groups.items())
        )

    async def _send_node(
        self, node: Node, indexes: list[int], commands: list[Command], replies: list[Any]
    ) -> None:
        try:
            results = await self._sender(node).send([commands[i] for i in indexes])
        except (RedisError, OSError) as exc:  # this master only: the others' replies stand
            self._stale_map = True
            results = [exc] * len(indexes)
        for index, result in zip(indexes, results, strict=True):
            replies[index] = result
            if isinstance(result, ClusterDownError):
                self._stale_map = True

    async def _follow_moved(self, commands: list[Command], replies: list[Any]) -> None:
        moved = [i for i, reply in enumerate(replies) if isinstance(reply, MovedError)]
        if not moved:
            return
        if internals.available("redis-move-slot"):
            for index in moved:
                await self._cluster.nodes_manager.move_slot(replies[index])
        else:  # the public path: the whole map again
            await self._cluster.nodes_manager.initialize()
        await self._send_grouped(commands, moved, replies)

    async def _follow_ask(self, commands: list[Command], replies: list[Any]) -> None:
        asked: dict[Node, list[int]] = {}
        for index, reply in enumerate(replies):
            if isinstance(reply, AskError) and not isinstance(reply, MovedError):
                asked.setdefault((reply.host, int(reply.port)), []).append(index)
        for node, indexes in asked.items():
            batch = [part for i in indexes for part in (("ASKING",), commands[i])]
            try:
                results = (await self._sender(node).send(batch))[1::2]
            except (RedisError, OSError) as exc:
                results = [exc] * len(indexes)
            for index, result in zip(indexes, results, strict=True):
                replies[index] = result

    def _node_of(self, key: str) -> Node:
        node: ClusterNode = self._cluster.nodes_manager.get_node_from_slot(slot_of(key))
        return node.host, int(node.port)

    def _sender(self, address: Node) -> ConnectionSender:
        sender = self._senders.get(address)
        if sender is None:
            template = self._cluster.get_default_node()
            kwargs = {**template.connection_kwargs, "host": address[0], "port": address[1]}
            sender = ConnectionSender(connection_class=template.connection_class, **kwargs)
            sender.expedite(self._expedited)
            self._senders[address] = sender
        return sender

    async def _refresh_if_stale(self) -> None:
        """Reload the slot map after a master failed, at most every ``REFRESH_EVERY``
        seconds; drop the connections of nodes that no longer serve slots."""
        await self._cluster.initialize()
        now = time.monotonic()
        if not self._stale_map or now - self._refreshed_at < REFRESH_EVERY:
            return
        self._refreshed_at = now
        try:
            await self._cluster.nodes_manager.initialize()
        except (RedisError, RedisClusterException) as exc:
            log.info("reloading the cluster's slot map failed (%s); retrying", exc)
            return
        self._stale_map = False
        masters = {(node.host, int(node.port)) for node in self._cluster.get_primaries()}
        for address in [address for address in self._senders if address not in masters]:
            await self._senders.pop(address).aclose()


def default_sender(redis: RedisClient) -> BatchSender:
    """:class:`ConnectionSender`; on a Cluster, :class:`ClusterSender` (a connection per
    master); for an in-process stand-in Redis (fakeredis: the demo), which has no
    connection of its own to make, :class:`PipelineSender`."""
    if isinstance(redis, RedisCluster):
        return ClusterSender(redis)
    if is_fake(redis):
        return PipelineSender(redis)
    return ConnectionSender(redis)
