"""A route's target choice (``sched/routes.lua``) against a real redis-server: given each
target's health and each upstream's room, the script chooses what docs/routing.md says
(hypothesis draws the states), the weighted strategy keeps exact shares, and the breaker's
cooldowns grow and end as documented."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis

from tests.helpers.servers import RedisServer, needs_redis_server
from worker.store.keys import Keys
from worker.store.scheduler import HEAL, ROUTE, TRIP

HEALTHS = ("up", "cold", "trial", "down", "probe", "probing")
ROOMS = ("room", "full", "unreachable")
UPSTREAMS = ("a", "b", "c")
WAIT = "wait"


@pytest.fixture
def sync_redis(redis_server: RedisServer | None) -> Iterator[Redis]:
    server = needs_redis_server(redis_server)
    client = Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()


class Shard:
    """One scheduler shard under a fresh prefix, its state written directly."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.keys = Keys(f"t-{uuid.uuid4().hex[:12]}")
        self.prefix = self.keys.sched(0)
        self.route = redis.register_script(ROUTE)
        self.trip = redis.register_script(TRIP)
        self.heal = redis.register_script(HEAL)

    def key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def configure(self, targets: list[tuple[str, str, float]], strategy: str) -> None:
        route = {"s": strategy, "t": [[u, m, w] for u, m, w in targets]}
        self.redis.hset(
            self.key("config"),
            mapping={
                "lease_ms": 30_000,
                "r:r": json.dumps(route),
                **{f"u:{u}": "1||" for u in UPSTREAMS},
            },
        )

    def choose(self, job: str = "j", entry: str = "1-0") -> tuple[str, int | None, bool]:
        args: list[str | int] = [job, entry, "r", 10, "", ""]
        reply: Any = self.route(keys=[self.keys.queue, self.prefix], args=args)
        if reply[0] == "target":
            return "target", int(reply[1]), int(reply[2]) == 1
        return reply[0], None, False

    def set_health(self, upstream: str, model: str, health: str, now_ms: int) -> None:
        target = f"{upstream}|{model}"
        if health == "up":
            self.redis.set(self.key(f"ok:{target}"), "1")
        elif health == "trial":
            self.redis.set(self.key(f"trial:{target}"), "4")
        elif health in ("down", "probe", "probing"):
            until = now_ms + 60_000 if health == "down" else now_ms - 1
            key = self.key(f"down:{target}")
            self.redis.hset(key, mapping={"until": until, "since": now_ms - 5_000, "fails": 1})
            if health == "probing":
                self.redis.hset(key, mapping={"probe": "other", "probe_at": now_ms - 1})

    def set_room(self, upstream: str, room: str, now_ms: int) -> None:
        if room == "full":  # its one permit (max_concurrent 1) is held
            self.redis.zadd(self.key(f"permits:{upstream}"), {"held-0": now_ms})
        elif room == "unreachable":
            self.redis.hset(self.key(f"down:{upstream}"), mapping={"until": now_ms + 60_000})


def expected_fallback(targets: list[tuple[str, str]], rooms: dict[str, str]) -> Any:
    """docs/routing.md: the first target in order that is up and has room; a target still on
    trial makes the job wait for its answers; none: wait."""
    for index, (upstream, health) in enumerate(targets):
        if rooms[upstream] == "unreachable" or health in ("down", "probing"):
            continue
        if rooms[upstream] == "full":
            continue
        if health == "trial":
            return WAIT
        return index, health == "probe"
    return WAIT


target_states = st.lists(
    st.tuples(st.sampled_from(UPSTREAMS), st.sampled_from(HEALTHS)), min_size=1, max_size=4
)
room_states = st.fixed_dictionaries({u: st.sampled_from(ROOMS) for u in UPSTREAMS})


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(targets=target_states, rooms=room_states)
def test_fallback_takes_the_first_target_that_is_up_and_has_room(
    sync_redis: Redis, targets: list[tuple[str, str]], rooms: dict[str, str]
) -> None:
    shard = Shard(sync_redis)
    now = int(time.time() * 1000)
    shard.configure([(u, f"m{i}", 1.0) for i, (u, _) in enumerate(targets)], "fallback")
    for i, (upstream, health) in enumerate(targets):
        shard.set_health(upstream, f"m{i}", health, now)
    for upstream, room in rooms.items():
        shard.set_room(upstream, room, now)
    got = shard.choose()
    expected = expected_fallback(targets, rooms)
    if expected == WAIT:
        assert got[0] == WAIT, (targets, rooms, got)
    else:
        assert (got[1], got[2]) == expected, (targets, rooms, got)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    targets=target_states,
    rooms=room_states,
    weights=st.lists(st.integers(1, 5), min_size=4, max_size=4),
)
def test_weighted_chooses_only_a_target_that_is_up_and_has_room(
    sync_redis: Redis, targets: list[tuple[str, str]], rooms: dict[str, str], weights: list[int]
) -> None:
    shard = Shard(sync_redis)
    now = int(time.time() * 1000)
    shard.configure(
        [(u, f"m{i}", float(weights[i])) for i, (u, _) in enumerate(targets)], "weighted"
    )
    for i, (upstream, health) in enumerate(targets):
        shard.set_health(upstream, f"m{i}", health, now)
    for upstream, room in rooms.items():
        shard.set_room(upstream, room, now)
    eligible = {
        i
        for i, (upstream, health) in enumerate(targets)
        if rooms[upstream] == "room" and health not in ("down", "probing")
    }
    state, index, _ = shard.choose()
    if state == WAIT:  # none eligible, or the weighted choice fell on a target on trial
        assert not eligible or any(targets[i][1] == "trial" for i in eligible)
    else:
        assert index in eligible and targets[index][1] != "trial", (targets, rooms, index)


def test_weighted_shares_are_exact_over_each_round(sync_redis: Redis) -> None:
    shard = Shard(sync_redis)
    shard.configure([("a", "m0", 1.0), ("b", "m1", 3.0), ("c", "m2", 2.0)], "weighted")
    sync_redis.delete(*(shard.key(f"u:{u}") for u in UPSTREAMS))
    sync_redis.hdel(shard.key("config"), *(f"u:{u}" for u in UPSTREAMS))  # no limits
    for i, upstream in enumerate("abc"):
        shard.set_health(upstream, f"m{i}", "up", 0)
    picks = [shard.choose(entry=f"{n}-0")[1] or 0 for n in range(60)]
    for start in range(0, 60, 6):
        assert sorted(picks[start : start + 6]) == [0, 1, 1, 1, 2, 2], picks
    runs = [len(list(run)) for _, run in itertools.groupby(picks)]
    assert max(runs) <= 2, picks  # smooth: never three in a row of one target


def test_a_cooldown_doubles_with_each_failed_probe_and_a_success_ends_it(
    sync_redis: Redis,
) -> None:
    shard = Shard(sync_redis)
    keys = [shard.keys.queue, shard.prefix]

    def trip(job: str, retry_after: str = "") -> int:
        return int(shard.trip(keys=keys, args=["a", "m", 1000, 8000, retry_after, "HTTP 500", job]))

    assert trip("j1") == 1000  # the first failure: the cooldown
    assert trip("j2") <= 1000  # a job sent before it went down: nothing changes
    sync_redis.hset(shard.key("down:a|m"), mapping={"until": 0, "probe": "p1"})
    assert 1900 <= trip("p1") <= 2000  # its probe failed: twice as long
    sync_redis.hset(shard.key("down:a|m"), mapping={"until": 0, "probe": "p2"})
    assert 3900 <= trip("p2") <= 4000
    for probe in ("p3", "p4"):
        sync_redis.hset(shard.key("down:a|m"), mapping={"until": 0, "probe": probe})
        assert trip(probe) <= 8000  # capped
    assert trip("j3", retry_after="30000") >= 29_000  # a longer Retry-After extends it
    assert int(shard.heal(keys=keys, args=["a", "m", 30_000])) == 1
    assert not sync_redis.exists(shard.key("down:a|m"))
    assert sync_redis.exists(shard.key("ok:a|m"))
