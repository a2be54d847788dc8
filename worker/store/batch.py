"""One round trip for many commands, each with its own reply.

The publisher hands a batch of commands (one tuple of arguments each, as Redis receives
them) to a sender and reads one reply per command, in order: a command Redis refused comes
back as its exception, not raised, so the others' replies still count. A failure of the
round trip as a whole (a lost connection, no reply in time) is raised as a ``RedisError``,
and the next ``send`` connects again.

:class:`ConnectionSender` (the default) writes a batch as one packed write on a connection
of its own and reads the replies with that connection's parser (hiredis when installed).
:class:`PipelineSender` is redis-py's non-transactional pipeline: the same contract at
about three times the CPU per command (docs/decisions.md, 38). Other senders (one that
splits a batch by Redis Cluster node) keep this contract.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, DefaultParser
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker.aio import URGENT
from worker.store.redis_client import connection_socket

Command = tuple[Any, ...]  # e.g. ("EVALSHA", sha, 2, key, key, arg, ...)
Packer = Callable[[list[Command]], "bytes | list[bytes]"]


class BatchSender(Protocol):
    async def send(self, commands: list[Command]) -> list[Any]:
        """One reply per command, in order; a refused command's reply is its exception."""
        ...

    async def aclose(self) -> None:
        """Release what the sender holds of its own (a connection); it is not used again."""
        ...

    def expedite(self, on: bool) -> None:
        """While on, a reply ends the wake-up tick's sleep (``worker.aio.URGENT``)."""
        ...


class PipelineSender:
    """redis-py's pipeline (``transaction=False``), on the client's connection pool."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def send(self, commands: list[Command]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def aclose(self) -> None:
        pass  # the pool belongs to the client

    def expedite(self, on: bool) -> None:
        pass  # the pool's connections are watched anyway


class ConnectionSender:
    """A connection of its own (the client's settings: host, TLS, auth, db, parser): each
    batch is packed into one write (``hiredis.pack_command`` when the parser is hiredis,
    else redis-py's ``pack_commands``) and its replies are read under one timeout, the
    client's ``socket_timeout``, instead of one per reply. Replies are raw: not decoded,
    nor passed through redis-py's response callbacks (the publisher's scripts answer
    integers)."""

    def __init__(
        self, redis: Redis | None = None, *, connection_class: Any = None, **kwargs: Any
    ) -> None:
        """On a connection made like ``redis``'s pool makes them, or of ``connection_class``
        with ``kwargs`` (a Cluster node's)."""
        if redis is not None:
            connection_class = redis.connection_pool.connection_class
            kwargs = dict(redis.connection_pool.connection_kwargs)
        self._timeout: float | None = kwargs.get("socket_timeout")
        kwargs["socket_timeout"] = None  # one deadline per round trip, below
        self._connection: AbstractConnection = connection_class(**kwargs)
        self._pack = packer(self._connection, kwargs.get("parser_class", DefaultParser))
        self._expedited = False  # replies end the tick's sleep (else they wait for its end)

    async def send(self, commands: list[Command]) -> list[Any]:
        connection = self._connection
        try:
            async with asyncio.timeout(self._timeout):
                if not connection.is_connected:  # connect(): a Sentinel's finds the master
                    await connection.connect()  # type: ignore[no-untyped-call]
                    self.expedite(self._expedited)  # (connections join URGENT)
                await connection.send_packed_command(self._pack(commands), check_health=False)
                return await _replies(connection, len(commands))
        except TimeoutError:
            await connection.disconnect(nowait=True)
            raise RedisTimeoutError(
                f"no reply from Redis in {self._timeout:g}s to a batch of {len(commands)}"
            ) from None
        except BaseException:
            # a reply was cut (lost connection, cancellation): the stream is out of step
            await connection.disconnect(nowait=True)
            raise

    async def aclose(self) -> None:
        await self._connection.disconnect()

    def expedite(self, on: bool) -> None:
        self._expedited = on
        if self._connection.is_connected:
            (URGENT.watch if on else URGENT.forget)(connection_socket(self._connection))


async def _replies(connection: AbstractConnection, count: int) -> list[Any]:
    """``count`` replies in order, through redis-py's ``read_response`` (its parser: hiredis
    when installed); a refused command's error is its reply, the others' still follow."""
    replies: list[Any] = []
    read = connection.read_response
    for _ in range(count):
        try:
            replies.append(await read(disable_decoding=True))
        except ResponseError as exc:
            replies.append(exc)
    return replies


def packer(connection: AbstractConnection, parser_class: type[Any]) -> Packer:
    """The batch packer: hiredis's C packer when the connection parses with hiredis."""
    if "hiredis" in parser_class.__name__.lower():
        import hiredis

        pack = hiredis.pack_command
        return lambda commands: b"".join([pack(command) for command in commands])
    return connection.pack_commands
