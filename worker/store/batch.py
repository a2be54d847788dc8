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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from worker import internals
from worker.aio import URGENT
from worker.store.redis_client import connection_socket

try:  # what redis-py's hiredis reader answers while a reply is incomplete
    from redis._parsers.hiredis import NOT_ENOUGH_DATA
except ImportError:  # pragma: no cover (another redis-py: read through redis-py)
    NOT_ENOUGH_DATA = None


def _push_type() -> Any:
    """hiredis's type of a RESP3 push message (hiredis >= 3.2), or None."""
    try:
        import hiredis
    except ImportError:  # pragma: no cover (no hiredis: its reader is never found)
        return None
    return getattr(hiredis, "PushNotification", None)


_PUSH = _push_type()

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
    """``count`` replies in order (one coroutine for all: the per-reply cost is the parser's)."""
    reader = hiredis_reader(connection)
    if reader is not None:
        return await _hiredis_replies(connection, reader, count)
    replies: list[Any] = []
    read = connection.read_response
    for _ in range(count):
        try:
            replies.append(await read(disable_decoding=True))
        except ResponseError as exc:  # refused: the others' replies still follow
            replies.append(exc)
    return replies


def hiredis_reader(connection: AbstractConnection) -> Any:
    """The ``hiredis.Reader`` of a connection that parses with hiredis, else None.

    Its replies are then taken from the reader in one loop (``_hiredis_replies``), without
    redis-py's three layers per reply (a third of the publisher's cost per entry, decision
    65). The reader is redis-py's private attribute, checked once (``worker.internals``):
    without it the replies are read through redis-py as before."""
    if not internals.available("redis-hiredis-reader"):
        return None
    parser = getattr(connection, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is None or NOT_ENOUGH_DATA is None or not hasattr(parser, "read_from_socket"):
        return None
    return reader


async def _hiredis_replies(connection: AbstractConnection, reader: Any, count: int) -> list[Any]:
    """What redis-py's ``read_response`` does per reply, for ``count`` replies: a refused
    command's error is its reply, one that says the server cannot serve (``LOADING``, a
    ``ConnectionError``) fails the round trip, as does a lost connection; a RESP3 push
    message between replies goes to the parser's handler, as redis-py does."""
    parser: Any = connection._parser  # (hiredis_reader)
    replies: list[Any] = []
    gets = reader.gets
    while len(replies) < count:
        reply = gets(False)
        if reply is NOT_ENOUGH_DATA:
            try:
                await parser.read_from_socket()
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from Redis: {exc}") from exc
        elif isinstance(reply, RedisConnectionError):
            raise reply
        elif _PUSH is not None and isinstance(reply, _PUSH):
            await parser.handle_push_response(reply)
        else:
            replies.append(reply)
    return replies


def packer(connection: AbstractConnection, parser_class: type[Any]) -> Packer:
    """The batch packer: hiredis's C packer when the connection parses with hiredis."""
    if "hiredis" in parser_class.__name__.lower():
        import hiredis

        pack = hiredis.pack_command
        return lambda commands: b"".join([pack(command) for command in commands])
    return connection.pack_commands
