"""One round trip for many commands, each with its own reply.

The publisher hands a batch of commands (one tuple of arguments each, as Redis receives
them) to a sender and reads one reply per command, in order: a command Redis refused comes
back as its exception, not raised, so the others' replies still count. A failure of the
round trip as a whole (a lost connection) is raised.

:class:`PipelineSender` is redis-py's non-transactional pipeline. Other senders (a cheaper
single-connection one, one that splits a batch by Redis Cluster node) keep this contract.
"""

from __future__ import annotations

from typing import Any, Protocol

from redis.asyncio import Redis

Command = tuple[Any, ...]  # e.g. ("EVALSHA", sha, 2, key, key, arg, ...)


class BatchSender(Protocol):
    async def send(self, commands: list[Command]) -> list[Any]:
        """One reply per command, in order; a refused command's reply is its exception."""
        ...


class PipelineSender:
    """redis-py's pipeline (``transaction=False``)."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def send(self, commands: list[Command]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))
