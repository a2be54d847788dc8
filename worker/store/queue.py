"""The job queue: Redis Streams (one per shard) read through the consumer group ``workers``.

An entry ``{job: <id>}`` stands for "run this job". A worker reads entries with
XREADGROUP (blocking, at most as many as it has free slots); the entry then sits in the
group's pending list, owned by that worker, until it is acked and deleted after the job's
terminal write. The entry's idle time is the lease: the owner renews it (XCLAIM of its own
entries), and an entry idle longer than the lease belongs to a dead worker and is taken
over by XAUTOCLAIM; a worker whose heartbeat stopped has all its entries taken over at once
(``take_over``). Before starting a job a worker checks, in one script, that the entry is still
its own and was delivered less than a lease ago (``claim_for_start``): a reply read late by a
frozen process starts nothing. Acks and hand-backs check ownership in the same script: a
worker never acks an entry another worker took over. A consumer group that vanished (Redis
restarted empty) is recreated by the next read. The dead-letter stream lists jobs that
exhausted their attempts. See docs/reliability.md.

Every script touches one shard's stream only (one key, one Cluster slot).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from worker.aio import cancel_and_wait
from worker.store import lua
from worker.store.keys import GROUP, Keys
from worker.store.records import as_text, dumps
from worker.store.redis_client import RedisClient, stream_replies
from worker.store.scheduler import NoGroupError, Scheduler

log = logging.getLogger("chatstream.queue")

# Scripts read the pending list with redis.pcall: without the group (Redis restarted empty)
# no entry is anybody's, which is what they answer instead of failing.

RENEW = lua.script("queue/renew", with_lib=True)

SETTLE = lua.script("queue/settle", with_lib=True)

CLAIM_FOR_START = lua.script("queue/claim_for_start")

TAKE_OVER = lua.script("queue/take_over")

LEAVE = lua.script("queue/leave")

PRUNE = lua.script("queue/prune")


@dataclass(frozen=True, slots=True)
class Entry:
    """One queue entry as delivered to this worker."""

    entry_id: str
    job_id: str | None  # None when the entry is garbage (no ``job`` field)
    raw: dict[str, str]
    shard: int = 0

    @property
    def ref(self) -> str:
        """The entry's name across shards (stream ids repeat between streams): its id on
        shard 0, ``<shard>/<id>`` on the others. The record's ``entry`` field holds it."""
        return self.entry_id if self.shard == 0 else f"{self.shard}/{self.entry_id}"

    @property
    def permit(self) -> str:
        """The upstream whose permit the entry holds ('' = none: that upstream has no
        limits, or a producer wrote the entry itself)."""
        return self.raw.get("permit", "")

    @property
    def tenant(self) -> str:
        return self.raw.get("tenant", "default")

    @property
    def route(self) -> str:
        """The route the scheduler chose the entry's target from ('' = none)."""
        return self.raw.get("route", "")

    @property
    def target(self) -> int | None:
        """The index of the route's target the scheduler chose (None: no route)."""
        value = self.raw.get("target", "")
        return int(value) if value.isdigit() else None

    @property
    def probe(self) -> bool:
        """The job is the one that tries the target after its cooldown."""
        return self.raw.get("probe") == "1"

    @property
    def dispatched_at(self) -> float | None:
        """When the scheduler moved the job into the stream (its entry id's time), Unix
        seconds; None for an entry a producer added itself."""
        if "tenant" not in self.raw:
            return None
        return int(self.entry_id.partition("-")[0]) / 1000


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry of the dead-letter stream."""

    entry_id: str
    job_id: str
    reason: dict[str, Any]


class Queue:
    """The consumer group on every shard of the queue (``Keys.queues``).

    With one shard, reads block on it. With several, a read first takes what is waiting on
    each shard in turn (starting one shard further each time, so none is favoured), and
    only when all are empty waits on all of them at once: one blocking read per shard, each
    for its share of the free slots, on connections of their own. A blocking read that
    outlives the call is picked up by the next one, so a worker may hold up to one entry per
    shard beyond its free slots (they wait for a slot, leased). Every script touches one
    shard (one key, one Cluster slot).
    """

    def __init__(self, redis: RedisClient, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._renew = redis.register_script(RENEW)
        self._settle = redis.register_script(SETTLE)
        self._leave = redis.register_script(LEAVE)
        self._prune = redis.register_script(PRUNE)
        self._claim_for_start = redis.register_script(CLAIM_FOR_START)
        self._take_over = redis.register_script(TAKE_OVER)
        self._reclaim_cursor = ["0-0"] * keys.shards
        self._reclaim_shard = 0
        self._next_shard = 0
        self._waiting: dict[int, tuple[asyncio.Task[list[Entry]], int]] = {}  # shard: read, share
        self.scheduler = Scheduler(redis, keys)
        self._held_back_ms = -1  # from the last picks: until a limit may let a job go

    @property
    def shards(self) -> range:
        return range(self.keys.shards)

    def _rotation(self) -> list[int]:
        """Every shard once, starting one further than last time."""
        first, self._next_shard = self._next_shard, (self._next_shard + 1) % self.keys.shards
        return [(first + i) % self.keys.shards for i in self.shards]

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) of every shard unless it exists; from
        entry 0, so entries added before it are delivered too."""
        for shard in self.shards:
            await self._ensure_group(shard)

    async def _ensure_group(self, shard: int) -> None:
        try:
            await self.redis.xgroup_create(
                self.keys.queue_shard(shard), GROUP, id="0", mkstream=True
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _recreate_group(self, shard: int, exc: ResponseError) -> None:
        log.warning("the queue's consumer group is gone (%s); recreating it", exc)
        await self._ensure_group(shard)
        self._reclaim_cursor[shard] = "0-0"

    async def add(self, job_id: str) -> str:
        """A queue entry for the job, on its shard (``Keys.shard_of``), straight into the
        stream: ahead of every tenant's queue and outside the limits (the way back for a
        job whose entry Redis lost)."""
        key = self.keys.queue_of(job_id)
        return as_text(await self.redis.xadd(key, {"job": job_id}))

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries for this consumer, at most ``count``; waits up to ``block_ms`` when
        there are none (None: does not wait). Recreates a group that is gone."""
        if self.keys.shards == 1:
            return await self._read_shard(0, count, block_ms)
        entries = self._ready()
        budget = count - self._reserved()  # what reads still waiting may deliver is theirs
        for shard in self._rotation():
            if len(entries) >= budget:
                break
            if shard not in self._waiting:
                entries += await self._read_shard(shard, budget - len(entries), None)
        if entries or block_ms is None:
            return entries
        return await self._wait_any(count, self._block(block_ms))

    def _block(self, block_ms: int) -> int:
        """How long a blocking read may wait: until a limit may let a held-back job go."""
        held_back, self._held_back_ms = self._held_back_ms, -1
        return block_ms if held_back < 0 else max(1, min(block_ms, held_back))

    def _reserved(self) -> int:
        return sum(share for _, share in self._waiting.values())

    def _ready(self) -> list[Entry]:
        """What blocking reads left by an earlier call delivered since."""
        entries: list[Entry] = []
        for shard, (task, _) in list(self._waiting.items()):
            if task.done():
                del self._waiting[shard]
                if not task.cancelled() and task.exception() is None:
                    entries += task.result()
        return entries

    async def _wait_any(self, count: int, block_ms: int) -> list[Entry]:
        """A blocking read on every shard not read yet, each for a share of what the reads
        still waiting left of ``count``; returns once one delivered (or all timed out)."""
        idle = [shard for shard in self.shards if shard not in self._waiting]
        share = max(1, (count - self._reserved()) // max(1, len(idle)))
        for shard in idle:
            read = asyncio.create_task(
                self._wait_shard(shard, share, block_ms), name=f"queue-read-{shard}"
            )
            self._waiting[shard] = (read, share)
        tasks = [task for task, _ in self._waiting.values()]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        failed = [task.exception() for task in done if not task.cancelled()]
        entries = self._ready()
        if not entries and (error := next((exc for exc in failed if exc is not None), None)):
            raise error
        return entries

    async def _read_shard(self, shard: int, count: int, block_ms: int | None) -> list[Entry]:
        """What waits in the shard's stream, then its fairest waiting jobs (the scheduler's
        pick); with ``block_ms``, when there is neither, waits for an entry that long."""
        try:
            rows, held_back = await self.scheduler.pick(shard, self.consumer, count)
        except NoGroupError as exc:
            await self._recreate_group(shard, ResponseError(str(exc)))
            return []
        if held_back >= 0 and not 0 <= self._held_back_ms <= held_back:
            self._held_back_ms = held_back
        if rows or block_ms is None:
            return [_entry(eid, _pairs(fields), shard) for eid, fields in rows]
        return await self._wait_shard(shard, count, self._block(block_ms))

    async def _wait_shard(self, shard: int, count: int, block_ms: int) -> list[Entry]:
        """A blocking read: woken by a job moved into the stream (an enqueue, a permit that
        came free) or after ``block_ms``, then the shard is picked from again."""
        key = self.keys.queue_shard(shard)
        try:
            reply: Any = await self.redis.xreadgroup(
                GROUP, self.consumer, {key: ">"}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            await self._recreate_group(shard, exc)
            return []
        entries = [
            _entry(eid, fields, shard) for _, rows in stream_replies(reply) for eid, fields in rows
        ]
        if len(entries) < count:  # the wait ended: what else may go now
            entries += await self._read_shard(shard, count - len(entries), None)
        return entries

    async def close(self) -> None:
        """Stop the blocking reads still waiting (what they were delivered is handed back
        or reclaimed: it is in this consumer's pending list)."""
        await cancel_and_wait([task for task, _ in self._waiting.values()])
        self._waiting.clear()

    async def reclaim(self, count: int, lease_ms: int) -> list[Entry]:
        """Entries whose owner stopped renewing them for longer than the lease.

        XAUTOCLAIM scans a window of one shard's pending list per call; the cursor carries
        over between calls, and the next shard's turn comes when a shard's scan wrapped, so
        expired entries deep in a long pending list, or on any shard, are found too.
        """
        shard = self._reclaim_shard
        key = self.keys.queue_shard(shard)
        try:
            reply: Any = await self.redis.xautoclaim(
                key, GROUP, self.consumer, lease_ms, self._reclaim_cursor[shard], count=count
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            await self._recreate_group(shard, exc)
            return []
        self._reclaim_cursor[shard] = as_text(reply[0])
        if self._reclaim_cursor[shard] == "0-0":
            self._reclaim_shard = (shard + 1) % self.keys.shards
        return [_entry(eid, fields, shard) for eid, fields in reply[1] if fields is not None]

    async def renew(self, entries: list[Entry]) -> list[str]:
        """Reset the idle time of our entries; returns the refs of those another worker took."""
        lost: list[str] = []
        for shard, held in _by_shard(entries).items():
            args = [GROUP, self.consumer]
            for entry in held:
                args += [entry.entry_id, entry.permit]
            taken = await self._renew(keys=self._keys(shard), args=args)
            lost += [Entry(as_text(x), None, {}, shard).ref for x in taken]
        return lost

    def _keys(self, shard: int) -> list[str]:
        return self.scheduler.shard_keys(shard)

    async def claim_for_start(self, entry: Entry, lease_ms: int) -> int:
        """The entry's delivery count if it is ours and was delivered (or renewed) less than
        ``lease_ms`` ago, renewing it; 0 when it must not start (taken over, or a delivery a
        frozen process read late)."""
        args: list[str | int] = [GROUP, self.consumer, entry.entry_id, lease_ms]
        key = self.keys.queue_shard(entry.shard)
        return int(await self._claim_for_start(keys=[key], args=args))

    async def take_over(self, consumer: str, count: int) -> tuple[list[Entry], bool]:
        """Claim up to ``count`` entries of a dead consumer; also whether it holds no more."""
        taken: list[Entry] = []
        emptied = True
        for shard in self.shards:
            if len(taken) >= count:
                return taken, False
            args: list[str | int] = [GROUP, self.consumer, consumer, count - len(taken)]
            claimed, empty = await self._take_over(keys=[self.keys.queue_shard(shard)], args=args)
            taken += [_entry(row[0], _pairs(row[1]), shard) for row in claimed if row and row[1]]
            emptied = emptied and int(empty) == 1
        return taken, emptied

    async def owned(self, max_idle_ms: int | None = None, count: int = 10_000) -> list[Entry]:
        """The entries this consumer holds (without fields), optionally only those idle less
        than ``max_idle_ms``."""
        held: list[Entry] = []
        for shard in self.shards:
            rows = await self.redis.xpending_range(
                self.keys.queue_shard(shard),
                GROUP,
                min="-",
                max="+",
                count=count,
                consumername=self.consumer,
            )
            held += [
                Entry(as_text(row["message_id"]), None, {}, shard)
                for row in rows
                if max_idle_ms is None or int(row["time_since_delivered"]) < max_idle_ms
            ]
        return held

    async def stranded(
        self, min_idle_ms: int, count: int = 100, skip: Container[str] = ()
    ) -> list[Entry]:
        """Entries this consumer holds that nobody renewed for ``min_idle_ms``: delivered by
        a read whose reply was lost (Redis restarting, a partition), so the worker never saw
        them. They are claimed again (which renews them) and returned with their fields;
        those whose ``ref`` is in ``skip`` (the ones it runs) are left alone."""
        found: list[Entry] = []
        for shard in self.shards:
            if len(found) < count:
                found += await self._stranded(shard, min_idle_ms, count - len(found), skip)
        return found

    async def _stranded(
        self, shard: int, min_idle_ms: int, count: int, skip: Container[str]
    ) -> list[Entry]:
        key = self.keys.queue_shard(shard)
        try:
            rows = await self.redis.xpending_range(
                key, GROUP, "-", "+", count, consumername=self.consumer, idle=min_idle_ms
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            return []  # the next read recreates the group
        ids: list[Any] = [as_text(row["message_id"]) for row in rows]
        if skip:
            ids = [eid for eid in ids if Entry(eid, None, {}, shard).ref not in skip]
        if not ids:
            return []
        claimed: Any = await self.redis.xclaim(key, GROUP, self.consumer, min_idle_ms, ids)
        return [_entry(eid, fields, shard) for eid, fields in claimed if fields is not None]

    async def ack(self, entry: Entry) -> bool:
        """Ack and delete the entry if it is still ours (not taken over by another worker)."""
        args = [GROUP, self.consumer, entry.entry_id, ""]
        return int(await self._settle(keys=self._keys(entry.shard), args=args)) != 0

    async def requeue(self, entry: Entry, job_id: str) -> str | None:
        """Hand a job back at once: a fresh entry on the same shard replaces ours (None: it
        is not ours)."""
        args = [GROUP, self.consumer, entry.entry_id, job_id]
        fresh = await self._settle(keys=self._keys(entry.shard), args=args)
        return None if fresh == 0 else as_text(fresh)

    async def job_of(self, entry: Entry) -> str | None:
        """The job id of an entry still in the stream."""
        key = self.keys.queue_shard(entry.shard)
        rows: Any = await self.redis.xrange(key, entry.entry_id, entry.entry_id)
        return _entry(*rows[0]).job_id if rows else None

    async def leave(self) -> bool:
        """Remove this consumer from every shard's group if it holds no entries there
        (clean shutdown); True when it left them all."""
        left = True
        for key in self.keys.queues:
            left = int(await self._leave(keys=[key], args=[GROUP, self.consumer])) == 1 and left
        return left

    async def prune(self, idle_ms: int) -> int:
        """Remove the consumers of dead workers (no entries, idle ``idle_ms``); how many."""
        args: list[str | int] = [GROUP, idle_ms, self.consumer]
        removed = 0
        for key in self.keys.queues:
            removed += int(await self._prune(keys=[key], args=args))
        return removed

    # -- dead letters ----------------------------------------------------------------------

    async def dead_letter(self, job_id: str, reason: dict[str, Any]) -> str:
        fields = {"job": job_id, "reason": dumps(reason)}
        return as_text(await self.redis.xadd(self.keys.dead, fields))  # type: ignore[arg-type]

    async def dead_letters(self, count: int = 1000) -> list[DeadLetter]:
        """The dead-letter entries, oldest first."""
        rows: Any = await self.redis.xrange(self.keys.dead, count=count)
        return [_dead(eid, fields) for eid, fields in rows]

    async def forget_dead(self, job_id: str) -> int:
        """Delete the job's dead-letter entries; returns how many there were."""
        ids: list[str] = []
        cursor = "-"
        while True:
            rows: Any = await self.redis.xrange(self.keys.dead, cursor, "+", count=1000)
            ids += [as_text(eid) for eid, fields in rows if _dead(eid, fields).job_id == job_id]
            if len(rows) < 1000:
                break
            cursor = "(" + as_text(rows[-1][0])
        if ids:
            await self.redis.xdel(self.keys.dead, *ids)
        return len(ids)


def _by_shard(entries: list[Entry]) -> dict[int, list[Entry]]:
    grouped: dict[int, list[Entry]] = {}
    for entry in entries:
        grouped.setdefault(entry.shard, []).append(entry)
    return grouped


def _no_group(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def _pairs(flat: Any) -> dict[Any, Any]:
    """A script's flat [field, value, ...] list as a dict (XCLAIM's entry fields)."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _entry(entry_id: Any, fields: dict[Any, Any], shard: int = 0) -> Entry:
    raw = {as_text(k): as_text(v) for k, v in fields.items()}
    return Entry(as_text(entry_id), raw.get("job"), raw, shard)


def _dead(entry_id: Any, fields: dict[Any, Any]) -> DeadLetter:
    raw = {as_text(k): as_text(v) for k, v in fields.items()}
    try:
        reason: Any = json.loads(raw.get("reason") or "{}")
    except ValueError:
        reason = {"message": raw.get("reason", "")}
    return DeadLetter(
        as_text(entry_id), raw.get("job", ""), reason if isinstance(reason, dict) else {}
    )
