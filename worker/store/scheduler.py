"""Who runs next: tenants' queues with fair shares and priorities, and upstream limits.

A job does not go into the queue stream when it is enqueued: it waits in its tenant's
queue (one per tenant and upstream, ordered by priority, then arrival) on its shard. A job
leaves it only when a worker has a free slot for it and its upstream's limits let it go
(streams open at once, requests and tokens per minute, a pause after a 429); among the
tenants with such a job, the one with the lowest *pass* goes first, and its pass grows by
1 / its weight (stride scheduling: weighted round-robin). The move is one script per shard
(``sched/pick.lua``): the fair choice, the permit, the stream entry and its delivery to the
reading worker at once, so nothing is lost or counted twice. The same happens, for one job,
when a job is enqueued or a permit comes free and no entry waits in the stream for a
reader: a worker blocked reading the stream wakes with it.

A permit is held by the stream entry that carries the job (its ``permit`` field): renewed
with the entry's lease, freed by its ack, moved with it by a requeue or a take-over. One
that nobody renews for a lease (its worker died and nobody took the entry over) is free
again. Limits, weights and the lease are published by the workers into each shard's
``config`` hash, so producers need none of them. With N shards, each shard holds a 1/N
share of every limit (rounded up). See docs/decisions.md, 48, and docs/redis.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import AsyncScript

from schemas.requests import PRIORITY_RANK, ChatRequest
from worker.errors import QueueFullError
from worker.settings import Route, Settings, UpstreamLimits
from worker.store import lua
from worker.store.keys import Keys
from worker.store.records import as_text
from worker.store.redis_client import RedisClient

PUSH = lua.script("sched/push", with_lib=True)
PICK = lua.script("sched/pick", with_lib=True)
UNQUEUE = lua.script("sched/unqueue", with_lib=True)
REQUEST = lua.script("sched/request", with_lib=True)
COOL = lua.script("sched/cool", with_lib=True)
SPEND = lua.script("sched/spend", with_lib=True)
ROUTE = lua.script("sched/route", with_lib=True)
TRIP = lua.script("sched/trip", with_lib=True)
HEAL = lua.script("sched/heal", with_lib=True)
PAUSE = lua.script("sched/pause", with_lib=True)


@dataclass(frozen=True, slots=True)
class Waiting:
    """What a job's tenant queue entry says about it."""

    tenant: str
    upstream: str
    prompt_tokens: int
    max_tokens: int | None

    @classmethod
    def of(
        cls, request: ChatRequest, tenant: str, upstream: str, json_length: int | None = None
    ) -> Waiting:
        prompt = request.prompt_tokens_estimate(json_length)
        return cls(tenant, upstream, prompt, request.max_output_tokens())


Push = tuple[str, Waiting, str]  # a job to push: its id, what waits, its priority


@dataclass(slots=True)
class ShardCounts:
    """One shard's (or, summed, the queue's) waiting jobs and permits in use."""

    waiting: int = 0
    tenants: dict[str, int] = field(default_factory=dict)  # waiting jobs per tenant
    upstreams: dict[str, int] = field(default_factory=dict)  # waiting jobs per upstream
    permits: dict[str, int] = field(default_factory=dict)  # permits in use per upstream

    def add(self, other: ShardCounts) -> None:
        self.waiting += other.waiting
        for mine, theirs in (
            (self.tenants, other.tenants),
            (self.upstreams, other.upstreams),
            (self.permits, other.permits),
        ):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count


def shard_share(limit: int | None, shards: int) -> int | None:
    """A shard's share of a fleet-wide limit: never more than the limit in all."""
    return None if limit is None else max(1, math.ceil(limit / shards))


def config_fields(settings: Settings) -> dict[str, str]:
    """What workers publish into every shard's ``config`` hash."""
    shards = settings.queue_shards
    fields = {
        "lease_ms": str(int(settings.lease_seconds * 1000)),
        "est": str(settings.completion_tokens_estimate),
        "max_queued": str(shard_share(settings.max_queued, shards) or 0),
        "burst_ms": str(int(settings.requests_burst_seconds * 1000)),
    }
    for name, limits in settings.upstream_limits().items():
        fields[f"u:{name}"] = _limits_text(limits, shards)
    for tenant, weight in settings.tenant_weights.items():
        fields[f"w:{tenant}"] = repr(float(weight))
    for name in [*settings.upstream_names(), *settings.routes]:
        fields[f"s:{name}"] = "1"  # an upstream (or route) the workers serve
    for name, route in settings.routes.items():
        fields[f"r:{name}"] = route_text(name, route)
    return fields


def route_text(name: str, route: Route) -> str:
    """A route as the scheduler scripts read it (``sched/routes.lua``)."""
    targets = [[t.upstream, route.target_model(t, name), t.weight] for t in route.targets]
    text: dict[str, Any] = {"s": route.strategy, "t": targets}
    if (context := route.context_fallback) is not None:
        text["c"] = [context.upstream, route.target_model(context, name), context.weight]
    return json.dumps(text, separators=(",", ":"))


def _limits_text(limits: UpstreamLimits, shards: int) -> str:
    values = (limits.max_concurrent, limits.requests_per_minute, limits.tokens_per_minute)
    return "|".join(str(shard_share(value, shards) or "") for value in values)


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """What the route script needs of a started job's queue entry."""

    job_id: str
    entry_id: str
    shard: int
    route: str
    permit: str  # the upstream whose permit the entry holds, as the worker knows it
    context: bool = False  # it needs the route's context fallback


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """The route script's answer: a target (its index; whether the job is its probe), or
    seconds to wait (-0.001: until a permit comes free), or an unknown route."""

    target: int | None = None
    probe: bool = False
    wait: float = 0.0
    unknown: bool = False


@dataclass(frozen=True, slots=True)
class TargetFailure:
    """A failure that takes a route's target down for the fleet (``model`` empty: its
    upstream could not be reached, which takes down every target on it)."""

    upstream: str
    model: str
    cooldown: float
    max_cooldown: float
    retry_after: float | None
    why: str
    job_id: str

    def args(self) -> tuple[str | int, ...]:
        retry_after = "" if self.retry_after is None else int(self.retry_after * 1000)
        return (
            self.upstream,
            self.model,
            int(self.cooldown * 1000),
            int(self.max_cooldown * 1000),
            retry_after,
            self.why[:300],
            self.job_id,
        )


class Scheduler:
    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.push_script: AsyncScript = redis.register_script(PUSH)
        self._pick: AsyncScript = redis.register_script(PICK)
        self._unqueue: AsyncScript = redis.register_script(UNQUEUE)
        self._request: AsyncScript = redis.register_script(REQUEST)
        self._cool: AsyncScript = redis.register_script(COOL)
        self._spend: AsyncScript = redis.register_script(SPEND)
        self._route: AsyncScript = redis.register_script(ROUTE)
        self._trip: AsyncScript = redis.register_script(TRIP)
        self._heal: AsyncScript = redis.register_script(HEAL)
        self._pause: AsyncScript = redis.register_script(PAUSE)

    def shard_keys(self, shard: int) -> list[str]:
        return [self.keys.queue_shard(shard), self.keys.sched(shard)]

    def push_args(self, jobs: Sequence[Push], max_queued: int | None) -> list[Any]:
        """The push script's ``ARGV`` for ``jobs`` of one shard, in order."""
        args: list[Any] = [shard_share(max_queued, self.keys.shards) or 0]
        for job_id, waiting, priority in jobs:
            max_tokens = "" if waiting.max_tokens is None else waiting.max_tokens
            rank = PRIORITY_RANK[priority]
            args += (job_id, waiting.tenant, rank, waiting.upstream, waiting.prompt_tokens)
            args.append(max_tokens)
        return args

    async def push(
        self, job_id: str, waiting: Waiting, priority: str, max_queued: int | None = None
    ) -> str:
        """The job into its tenant's queue: ``queued``, or ``exists`` when it waits already;
        QueueFullError when its tenant has too many waiting (nothing is written)."""
        keys = self.shard_keys(self.keys.shard_of(job_id))
        args = self.push_args([(job_id, waiting, priority)], max_queued)
        replies = await self.push_script(keys=keys, args=args)
        return check_push(replies[0], waiting.tenant)

    async def pick(self, shard: int, consumer: str, count: int) -> tuple[Any, int]:
        """Up to ``count`` entries for ``consumer`` (raw XREADGROUP rows), and the ms until a
        time-bound limit may let a held-back job go (-1: none holds one back)."""
        reply: Any = await self._pick(keys=self.shard_keys(shard), args=[consumer, count])
        if as_text(reply[0]) == "nogroup":
            raise NoGroupError(as_text(reply[1]))
        return reply[0] or [], int(reply[1])

    async def unqueue(self, job_id: str) -> bool:
        """Take a waiting job out of its tenant's queue; False when it was not waiting."""
        keys = self.shard_keys(self.keys.shard_of(job_id))
        return int(await self._unqueue(keys=keys, args=[job_id])) == 1

    async def take_request(self, shard: int, upstream: str) -> float:
        """One more request to ``upstream`` (a retry): 0, or seconds to wait first."""
        waited = await self._request(keys=self.shard_keys(shard), args=[upstream])
        return int(waited) / 1000

    async def cool_down(self, upstream: str, seconds: float) -> None:
        """Nothing more goes to ``upstream`` for ``seconds``, from any worker (a 429)."""
        ms = max(1, int(seconds * 1000))
        for shard in range(self.keys.shards):
            await self._cool(keys=self.shard_keys(shard), args=[upstream, ms])

    async def route(self, entry: RouteEntry, tokens: int) -> RouteChoice:
        """A target of the entry's route for a started job (its permit moves to the
        target's upstream), or how long to wait for one."""
        context = "1" if entry.context else ""
        args: list[str | int] = [
            entry.job_id,
            entry.entry_id,
            entry.route,
            tokens,
            entry.permit,
            context,
        ]
        reply: Any = await self._route(keys=self.shard_keys(entry.shard), args=args)
        state = as_text(reply[0])
        if state == "target":
            return RouteChoice(target=int(reply[1]), probe=int(reply[2]) == 1)
        if state == "wait":
            return RouteChoice(wait=int(reply[1]) / 1000)
        return RouteChoice(unknown=True)

    async def trip(self, failure: TargetFailure) -> float:
        """A route's target (or, with no model, its upstream) failed: every worker skips it
        for a cooldown, then one job probes it; seconds until that probe."""
        args = list(failure.args())
        waits = [
            await self._trip(keys=self.shard_keys(shard), args=args)
            for shard in range(self.keys.shards)
        ]
        return int(waits[0]) / 1000

    async def heal(self, upstream: str, model: str, fresh_ms: int) -> bool:
        """Target (upstream, model) answered: up for every worker; True when it was down."""
        healed = False
        for shard in range(self.keys.shards):
            reply = await self._heal(keys=self.shard_keys(shard), args=[upstream, model, fresh_ms])
            healed = healed or int(reply) == 1
        return healed

    async def pause(self, upstream: str) -> bool:
        """Dispatch nothing more to ``upstream``, on every shard, until ``resume``; False when
        it was paused already. Jobs out of the queue go on; a running job's retries too."""
        changed = [await self._pause(keys=self.shard_keys(shard), args=["pause", upstream])
                   for shard in range(self.keys.shards)]  # fmt: skip
        return any(int(done) for done in changed)

    async def resume(self, upstream: str) -> bool:
        """Dispatch to ``upstream`` again (waking the queue); False when it was not paused."""
        changed = [await self._pause(keys=self.shard_keys(shard), args=["resume", upstream])
                   for shard in range(self.keys.shards)]  # fmt: skip
        return any(int(done) for done in changed)

    async def paused(self) -> dict[str, float]:
        """The paused upstreams and since when (Unix seconds; the earliest of the shards'),
        also those paused on some shards only (a pause cut short: pause again)."""
        since: dict[str, float] = {}
        for shard in range(self.keys.shards):
            raw: dict[Any, Any] = await self.redis.hgetall(self.keys.sched(shard) + ":paused")
            for name, ms in raw.items():
                when = int(as_text(ms)) / 1000
                since[as_text(name)] = min(when, since.get(as_text(name), when))
        return since

    async def spend(self, shard: int, upstream: str, entry_id: str, tokens: int) -> None:
        """A job's real token usage in place of the estimate it was admitted on."""
        await self._spend(keys=self.shard_keys(shard), args=[upstream, entry_id, tokens])

    async def publish(self, fields: Mapping[str, str]) -> dict[str, str]:
        """Write the workers' configuration into every shard (replacing the old one); the
        configuration found before, where it differed."""
        before: dict[str, str] = {}
        for shard in range(self.keys.shards):
            key = self.keys.sched(shard) + ":config"
            raw: dict[Any, Any] = await self.redis.hgetall(key)
            found = {as_text(k): as_text(v) for k, v in raw.items()}
            if found != dict(fields):
                before = before or found
                pipe = self.redis.pipeline(transaction=True)
                pipe.delete(key, self.keys.sched(shard) + ":last")  # ":last": before 0.2
                mapping: dict[Any, Any] = dict(fields)
                pipe.hset(key, mapping=mapping)
                await pipe.execute()
        return before

    async def publish_if_missing(self, fields: Mapping[str, str]) -> bool:
        """Publish again where a shard has no configuration (Redis restarted empty)."""
        missing = [
            shard
            for shard in range(self.keys.shards)
            if not await self.redis.hexists(self.keys.sched(shard) + ":config", "lease_ms")
        ]
        if missing:
            await self.publish(fields)
        return bool(missing)

    async def served(self) -> list[str] | None:
        """The upstream names the workers publish (None: no worker published any)."""
        raw: dict[Any, Any] = await self.redis.hgetall(self.keys.sched(0) + ":config")
        names = sorted(as_text(k)[2:] for k in raw if as_text(k).startswith("s:"))
        return names or None

    async def routes(self) -> frozenset[str]:
        """The route names the workers publish (``r:<name>`` in the configuration)."""
        raw: list[Any] = await self.redis.hkeys(self.keys.sched(0) + ":config")
        return frozenset(as_text(k)[2:] for k in raw if as_text(k).startswith("r:"))

    async def ahead_of(self, job_id: str, tenant: str, upstream: str) -> int | None:
        """How many jobs wait before this one in its tenant's queue for its upstream (None:
        it is not there: in the stream for the next free worker, or started)."""
        prefix = self.keys.sched(self.keys.shard_of(job_id))
        rank: Any = await self.redis.zrank(f"{prefix}:q:{tenant}:{upstream}", job_id)
        return None if rank is None else int(rank)

    async def holding_back(self, job_id: str, upstream: str) -> str | None:
        """What of its upstream's limits (or of its route's targets) holds a waiting job
        back on its shard, in words (None: nothing seen: it waits for a free worker or its
        tenant's turn)."""
        prefix = self.keys.sched(self.keys.shard_of(job_id))
        route = await self.redis.hget(prefix + ":config", f"r:{upstream}")
        if route:
            return await self._route_held(job_id, upstream, json.loads(as_text(route)))
        cool = int(await self.redis.pttl(f"{prefix}:cool:{upstream}"))
        if cool > 0:
            return f"upstream {upstream!r} is paused for {cool / 1000:.0f} s after a 429"
        limits = await self.redis.hget(prefix + ":config", f"u:{upstream}")
        concurrent = as_text(limits).split("|")[0] if limits else ""
        if not concurrent.isdigit():
            return None
        in_use = int(await self.redis.zcard(f"{prefix}:permits:{upstream}"))
        if in_use < int(concurrent):
            return None
        return f"a free stream of upstream {upstream!r} ({in_use} of {concurrent} at once in use)"

    async def _route_held(self, job_id: str, name: str, route: dict[str, Any]) -> str | None:
        """Why no target of route ``name`` takes the job: each target's breaker or limit."""
        shard = self.keys.shard_of(job_id)
        reasons = []
        for upstream, model, _ in route.get("t", []):
            why = ""
            for key in self.keys.breakers(shard, upstream, model):
                why = why or as_text(await self.redis.hget(key, "why") or "")
            held = why or await self.holding_back(job_id, upstream)
            if not held:
                return None  # this target may take it: it waits for a worker or its turn
            reasons.append(f"{upstream} model {model!r}: {why or held}")
        return f"no target of route {name!r} can take it now ({'; '.join(reasons)})"

    async def counts(self) -> ShardCounts:
        """Waiting jobs per tenant and upstream and permits in use, summed over shards."""
        total = ShardCounts()
        for shard in range(self.keys.shards):
            total.add(await self._shard_counts(shard))
        return total

    async def _shard_counts(self, shard: int) -> ShardCounts:
        prefix = self.keys.sched(shard)
        raw: dict[Any, Any] = await self.redis.hgetall(prefix + ":counts")
        counts = ShardCounts()
        for key, value in ((as_text(k), int(as_text(v))) for k, v in raw.items()):
            if key == "waiting":
                counts.waiting = max(0, value)
            elif key.startswith("t:") and value > 0:
                counts.tenants[key[2:]] = value
            elif key.startswith("u:") and value > 0:
                counts.upstreams[key[2:]] = value
        config: dict[Any, Any] = await self.redis.hgetall(prefix + ":config")
        for name in (as_text(k)[2:] for k in config if as_text(k).startswith("u:")):
            counts.permits[name] = int(await self.redis.zcard(f"{prefix}:permits:{name}"))
        return counts


class NoGroupError(Exception):
    """The shard's consumer group is gone (Redis restarted empty): recreate it."""


def check_push(reply: Any, tenant: str) -> str:
    state = as_text(reply[0])
    if state == "full":
        waiting = int(reply[1])
        raise QueueFullError(
            f"tenant {tenant!r} has {waiting} jobs waiting, the most CHATSTREAM_MAX_QUEUED "
            "allows; enqueue again once some have started",
            tenant=tenant,
            waiting=waiting,
        )
    return state
