"""worker.store.batch's senders against a real redis-server: one reply per command, in order; a
refused command's error is its reply; a lost or late round trip is raised and the next one
starts clean on a new connection. ``test_publisher.py`` and ``test_redis_faults.py`` run the
publisher's rules through the default sender; these pin the sender's own contract, for
both reply parsers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.helpers.servers import RedisServer
from worker import speedups
from worker.store.batch import Command, ConnectionSender, PipelineSender, packer
from worker.store.cluster_batch import default_sender

HIREDIS = speedups.hiredis_installed()
PARSERS = {"python": _AsyncRESP3Parser, **({"hiredis": _AsyncHiredisParser} if HIREDIS else {})}
needs_hiredis = pytest.mark.skipif(not HIREDIS, reason="needs hiredis (the fast extra)")
REFUSED: Command = ("EVAL", "return redis.error_reply('OOM command not allowed')", 0)


@pytest.fixture(params=sorted(PARSERS))
async def client(request: pytest.FixtureRequest, own_redis: RedisServer) -> AsyncIterator[Redis]:
    redis = Redis.from_url(own_redis.url, parser_class=PARSERS[request.param], socket_timeout=2)
    yield redis
    await redis.aclose()


async def test_replies_come_in_order_with_refusals_as_replies(client: Redis) -> None:
    sender = ConnectionSender(client)
    try:
        replies = await sender.send(
            [
                ("SET", "k", "é"),  # non-ASCII argument
                REFUSED,
                ("INCRBY", "n", 5),
                ("EVALSHA", "0" * 40, 0),  # an unknown script
                ("GET", "k"),
            ]
        )
    finally:
        await sender.aclose()
    assert replies[0] == b"OK"
    assert type(replies[1]).__name__ == "OutOfMemoryError"
    assert replies[2] == 5
    assert isinstance(replies[3], NoScriptError)
    assert replies[4] == "é".encode()


async def test_a_reply_that_says_redis_cannot_serve_fails_the_round_trip(client: Redis) -> None:
    """LOADING (a restarted Redis reading its data) is a connection error in redis-py: the
    round trip fails as a whole and is retried, with either parser."""
    sender = ConnectionSender(client)
    loading: Command = ("EVAL", "return redis.error_reply('LOADING Redis is loading')", 0)
    try:
        with pytest.raises(RedisConnectionError, match="loading"):
            await sender.send([("PING",), loading, ("PING",)])
        assert await sender.send([("PING",)]) == [b"PONG"]
    finally:
        await sender.aclose()


async def test_a_push_message_between_replies_is_not_taken_for_one(client: Redis) -> None:
    """RESP3 (redis-py's default): with client tracking on, Redis pushes an invalidation
    message to the sender's connection; it goes to the parser's handler, not into a batch's
    replies."""
    sender = ConnectionSender(client)
    try:
        assert await sender.send([("CLIENT", "TRACKING", "ON"), ("GET", "tracked")]) == [
            b"OK",
            None,
        ]
        await client.set("tracked", "changed")  # Redis pushes an invalidation to the sender
        await asyncio.sleep(0.05)
        assert await sender.send([("PING",), ("GET", "tracked")]) == [b"PONG", b"changed"]
    finally:
        await sender.aclose()


async def test_pipeline_sender_gives_the_same_script_replies(client: Redis) -> None:
    """What the publisher sends (scripts answering integers, or refused) gets the same
    replies; other commands' replies are raw (no redis-py response callbacks)."""
    commands: list[Command] = [
        ("EVAL", "return redis.call('INCR', KEYS[1])", 1, "m"),
        REFUSED,
        ("EVAL", "return tonumber(ARGV[1])", 0, "-1"),
    ]
    ours = ConnectionSender(client)
    try:
        mine = await ours.send(commands)
        await client.delete("m")
        theirs = await PipelineSender(client).send(commands)
    finally:
        await ours.aclose()
    assert [type(r) for r in mine] == [type(r) for r in theirs]
    assert mine[::2] == theirs[::2] == [1, -1]


async def test_a_killed_connection_is_raised_and_the_next_batch_reconnects(
    client: Redis,
) -> None:
    sender = ConnectionSender(client)
    try:
        assert await sender.send([("CLIENT", "SETNAME", "the-sender")]) == [b"OK"]
        await client.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(RedisConnectionError):
            await sender.send([("INCR", "after-kill")])
        assert await sender.send([("INCR", "after-kill")]) in ([1], [2])
    finally:
        await sender.aclose()


async def test_a_restarted_redis_is_reconnected_to(client: Redis, own_redis: RedisServer) -> None:
    sender = ConnectionSender(client)
    try:
        assert await sender.send([("PING",)]) == [b"PONG"]
        own_redis.stop()
        with pytest.raises(RedisError):
            await sender.send([("PING",)])
        own_redis.start()
        assert await sender.send([("PING",), ("DBSIZE",)]) == [b"PONG", 0]
    finally:
        await sender.aclose()


async def test_a_late_reply_is_a_timeout_and_never_read_as_the_next_batchs(
    own_redis: RedisServer,
) -> None:
    redis = Redis.from_url(own_redis.url, socket_timeout=0.2)
    sender = ConnectionSender(redis)
    try:
        with pytest.raises(RedisTimeoutError):
            await sender.send([("SET", "slow", "1"), ("BLPOP", "empty", "0.5"), ("GET", "slow")])
        await asyncio.sleep(0.5)  # the late replies have arrived by now, on the old socket
        assert await sender.send([("INCR", "fresh"), ("GET", "slow")]) == [1, b"1"]
    finally:
        await sender.aclose()
        await redis.aclose()


async def test_a_cancelled_round_trip_leaves_no_reply_behind(own_redis: RedisServer) -> None:
    redis = Redis.from_url(own_redis.url, socket_timeout=5)
    sender = ConnectionSender(redis)
    try:
        task = asyncio.create_task(sender.send([("BLPOP", "empty", "0.3"), ("INCR", "c")]))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        assert await sender.send([("ECHO", "a"), ("ECHO", "b")]) == [b"a", b"b"]
    finally:
        await sender.aclose()
        await redis.aclose()


async def test_a_large_batch_arrives_whole(client: Redis) -> None:
    big = "x" * 70_000  # several socket writes and reads per round trip
    commands: list[Command] = [("SET", f"big:{i}", big) for i in range(50)]
    commands += [("STRLEN", f"big:{i}") for i in range(50)]
    sender = ConnectionSender(client)
    try:
        replies = await sender.send(commands)
    finally:
        await sender.aclose()
    assert replies == [b"OK"] * 50 + [70_000] * 50


@needs_hiredis
def test_the_hiredis_packer_packs_as_redis_py_does(client: Redis) -> None:
    import hiredis

    connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    commands: list[Command] = [
        ("EVALSHA", "a" * 40, 2, "p:{j}", "p:{j}:events", 3, 17, '{"content":"é\\n"}', 86400),
        ("SET", b"\x00\xff", "v"),
    ]
    ours = packer(connection, _AsyncHiredisParser)(commands)
    theirs = packer(connection, _AsyncRESP3Parser)(commands)  # redis-py: a list of bytes
    assert isinstance(theirs, list)
    assert ours == b"".join(theirs) == b"".join(hiredis.pack_command(c) for c in commands)


def test_fakeredis_gets_the_pipeline_sender() -> None:
    import fakeredis

    assert isinstance(default_sender(fakeredis.FakeAsyncRedis()), PipelineSender)
    assert isinstance(default_sender(Redis()), ConnectionSender)
