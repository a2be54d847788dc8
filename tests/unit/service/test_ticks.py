"""WakeCoalescer: the loop sleeps out the tick only once it has gone idle, and only while
jobs run (a fake clock: the loop's own passes take no time, work takes what it says);
and a real worker turns it on for a job and off after it. UrgentSockets: news on a
watched socket ends the sleep, news on any other waits; which of a worker's sockets are
watched (its Redis connections but the publisher's)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn
from redis.asyncio import Redis

from tests.helpers.harness import Harness, chat, custom_harness
from tests.helpers.servers import RedisServer
from worker.aio import URGENT, UrgentSockets, socket_of
from worker.embedded_server import EmbeddedServer, bind, served
from worker.service.ticks import WakeCoalescer
from worker.settings import Settings
from worker.store.batch import ConnectionSender
from worker.store.redis_client import redis_from_settings

TICK = 0.004


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def passes(n: int) -> None:
    """Idle passes of the loop: nothing queued and no timer while the test waits (for a
    thread), so the coalescer sleeps (the fake clock's sleep returns at once)."""
    for _ in range(n):
        await asyncio.to_thread(time.sleep, 0.001)


async def test_an_idle_loop_sleeps_one_tick_per_pass_while_jobs_run() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(TICK, lambda: True, clock, clock.sleep)
    coalescer.resume()
    await passes(10)
    coalescer.stop()
    assert len(clock.slept) >= 5
    assert clock.slept == pytest.approx([TICK] * len(clock.slept))


async def test_no_sleep_while_callbacks_keep_the_loop_busy() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(TICK, lambda: True, clock, clock.sleep)
    coalescer.resume()
    for _ in range(20):  # a chain of wake-ups, each doing 1 ms of work
        clock.now += 0.001
        await asyncio.sleep(0)
    busy_sleeps = len(clock.slept)
    await passes(5)  # the chain ended: the loop is idle
    coalescer.stop()
    assert busy_sleeps == 0
    assert clock.slept, "an idle loop sleeps"
    # the first sleep after 20 ms of work: the tick began with the work, none of it is left
    assert clock.slept[0] == pytest.approx(TICK)


async def test_news_that_ends_a_sleep_early_does_not_restart_the_tick() -> None:
    """Woken 1 ms into a 4 ms tick (a job's start): the reads waiting for the tick are
    handled when it ends, 3 ms later, not a whole tick after the news."""
    clock = FakeClock()

    def woken_early_once(seconds: float) -> None:
        clock.slept.append(seconds)
        clock.now += 0.001 if len(clock.slept) == 1 else seconds

    coalescer = WakeCoalescer(TICK, lambda: True, clock, woken_early_once)
    coalescer.resume()
    await passes(3)
    coalescer.stop()
    assert clock.slept[:3] == pytest.approx([TICK, TICK - 0.001, TICK])


async def test_it_stops_when_no_job_runs_and_resumes_with_the_next() -> None:
    clock = FakeClock()
    jobs = [1]
    coalescer = WakeCoalescer(TICK, lambda: bool(jobs), clock, clock.sleep)
    coalescer.resume()
    await passes(3)
    assert coalescer.running
    jobs.clear()
    await passes(3)
    assert not coalescer.running
    slept = len(clock.slept)
    await passes(3)
    assert len(clock.slept) == slept  # the loop blocks in its poll again: no sleeps
    jobs.append(2)
    coalescer.resume()
    coalescer.resume()  # idempotent
    await passes(3)
    assert coalescer.running and len(clock.slept) > slept
    coalescer.stop()
    assert not coalescer.running


async def test_a_zero_tick_never_runs() -> None:
    clock = FakeClock()
    coalescer = WakeCoalescer(0.0, lambda: True, clock, clock.sleep)
    coalescer.resume()
    await passes(5)
    assert not coalescer.running and clock.slept == []


async def test_on_asyncios_loop_a_timer_ends_the_sleep_when_it_is_due() -> None:
    """A 20 ms timer under a 1 s tick fires on time: the sleep ends when it is due."""
    coalescer = WakeCoalescer(1.0, lambda: True)
    loop = asyncio.get_running_loop()
    fired = loop.create_future()
    coalescer.resume()
    try:
        await passes(3)  # the coalescer's first sleep begins with nothing due
        began = time.monotonic()
        loop.call_later(0.02, fired.set_result, None)
        await fired
        assert time.monotonic() - began < 0.5
    finally:
        coalescer.stop()
    assert coalescer.sleeps > 0


async def test_a_worker_paces_its_loop_only_while_it_runs_jobs(harness: Harness) -> None:
    if not URGENT.possible():
        pytest.skip("no epoll on this platform: no tick")
    async with custom_harness(harness, wake_tick_ms=12) as ticked:  # (whatever the environment)
        ticks = ticked.worker.ticks
        assert not ticks.running and ticks.sleeps == 0  # started, no job yet: no pacing
        record = await ticked.run(chat("hi", tokens=20))
        assert record.status == "succeeded"
        await passes(2)
        assert ticks.sleeps > 0  # the job waited for its upstream and Redis in ticks
        assert not ticks.running  # no job runs: the loop blocks in its poll again


# -- UrgentSockets: what may end a sleep early --------------------------------------------


def slept(urgent: UrgentSockets, seconds: float) -> float:
    began = time.monotonic()
    urgent.sleep(seconds)
    return time.monotonic() - began


def started() -> UrgentSockets:
    urgent = UrgentSockets()
    if not urgent.start():
        pytest.skip("no epoll on this platform")
    return urgent


def test_news_on_a_watched_socket_ends_the_sleep() -> None:
    urgent = started()
    ours, peer = socket.socketpair()
    with ours, peer:
        urgent.watch(ours)
        assert urgent.watching(ours)
        threading.Timer(0.05, peer.send, [b"x"]).start()
        assert slept(urgent, 5.0) < 2.5


def test_news_on_any_other_socket_waits_for_the_sleeps_end() -> None:
    urgent = started()
    forgotten, peer = socket.socketpair()
    unwatched, other_peer = socket.socketpair()
    with forgotten, peer, unwatched, other_peer:
        urgent.watch(forgotten)
        urgent.forget(forgotten)
        assert not urgent.watching(forgotten) and not urgent.watching(unwatched)
        peer.send(b"x")
        other_peer.send(b"y")
        assert slept(urgent, 0.1) >= 0.095


def test_while_a_connection_is_made_a_sleep_is_short() -> None:
    urgent = UrgentSockets()
    with urgent.hurry():
        assert slept(urgent, 5.0) < 1.0
    assert slept(urgent, 0.05) >= 0.045  # the hurry is over


async def test_a_workers_redis_connections_are_watched_the_publishers_when_expedited(
    settings: Settings, redis_server: RedisServer | None, urgent_set: None
) -> None:
    """A reply to a job's start or a cancel ends the tick's sleep; the publisher's only
    while something waits for it (else it shares the tick's wake-up with the reads)."""
    if redis_server is None:
        pytest.skip("no redis-server: no connections to watch")
    redis = redis_from_settings(settings)
    assert isinstance(redis, Redis)
    sender = ConnectionSender(redis)
    try:
        assert await redis.ping()
        assert await sender.send([("PING",)]) == [b"PONG"]
        pool = redis.connection_pool
        pooled = [
            socket_of(getattr(c._writer, "transport", None)) for c in pool._available_connections
        ]
        assert pooled and all(s is not None and URGENT.watching(s) for s in pooled)
        published = socket_of(getattr(sender._connection._writer, "transport", None))
        assert published is not None and not URGENT.watching(published)
        sender.expedite(True)
        assert URGENT.watching(published)
        sender.expedite(False)
        assert not URGENT.watching(published)
    finally:
        await sender.aclose()
        await redis.aclose()


async def test_an_embedded_servers_sockets_are_watched(urgent_set: None) -> None:
    """The gateway, the metrics server and the in-process mock share a worker's loop in
    some deployments and in tests: a request to them ends the tick's sleep."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, log_config=None, lifespan="off")
    server = EmbeddedServer(config, grace=0.1)
    listening = bind("127.0.0.1", 0)
    async with served(server, listening) as port:
        assert URGENT.watching(listening)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        accepted = [socket_of(p.transport) for p in server.server_state.connections]
        assert accepted and all(s is not None and URGENT.watching(s) for s in accepted)
        writer.close()


def test_on_uvloop_what_woke_the_loop_runs_before_the_next_sleep(urgent_set: None) -> None:
    """uvloop shows no queue: a reply's callbacks (here a task waiting for a read) are
    queued behind the coalescer in the pass that woke it; they run before it sleeps again."""
    uvloop = pytest.importorskip("uvloop")

    async def main() -> float:
        coalescer = WakeCoalescer(0.5, lambda: True, clock=lambda: 0.0)  # every pass quick
        ours, peer = socket.socketpair()
        ours.setblocking(False)
        with ours, peer:
            URGENT.watch(ours)
            coalescer.resume()
            try:
                await asyncio.sleep(0.01)
                threading.Timer(0.05, peer.send, [b"x"]).start()
                began = time.monotonic()
                assert await asyncio.get_running_loop().sock_recv(ours, 1) == b"x"
                return time.monotonic() - began
            finally:
                coalescer.stop()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) < 0.4
