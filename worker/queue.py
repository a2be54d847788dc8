"""The job queue: one Redis Stream read through the consumer group ``workers``.

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

Every script touches the queue stream only (one key, one Cluster slot).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from worker.keys import GROUP, Keys
from worker.records import as_text, dumps

log = logging.getLogger("chatstream.queue")

# Scripts read the pending list with redis.pcall: without the group (Redis restarted empty)
# no entry is anybody's, which is what they answer instead of failing.

# KEYS: queue. ARGV: group, consumer, entry ids... Renews only the entries still ours.
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if not p.err and p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# KEYS: queue. ARGV: group, consumer, entry id, job id ('' = ack only).
# Acks (and deletes) the entry if this consumer still owns it; with a job id, a fresh entry
# for the job replaces it. Returns the new entry id, 1 (acked), or 0 (not ours: no-op).
SETTLE = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p.err or not (p[1] and p[1][2] == ARGV[2]) then return 0 end
local fresh = 1
if ARGV[4] ~= '' then fresh = redis.call('XADD', KEYS[1], '*', 'job', ARGV[4]) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return fresh
"""

# KEYS: queue. ARGV: group, consumer, entry id, lease ms. Before a start: the entry is still
# ours and its delivery (or our last renewal) is younger than the lease. Renews it and
# returns its delivery count (the start's fencing token); 0 when it may not start.
CLAIM_FOR_START = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p.err or not (p[1] and p[1][2] == ARGV[2]) then return 0 end
if p[1][3] >= tonumber(ARGV[4]) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return p[1][4]
"""

# KEYS: queue. ARGV: group, consumer, dead consumer, count. Claims up to count entries of a
# consumer whose heartbeat stopped (their delivery counts go up: a takeover). Returns
# {entries, 1 if the dead consumer holds nothing more}.
TAKE_OVER = """
local rows = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[3])
if rows.err or #rows == 0 then return {{}, 1} end
local ids = {}
for i, row in ipairs(rows) do ids[i] = row[1] end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids))
local left = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[3])
return {claimed, #left == 0 and 1 or 0}
"""

# KEYS: queue. ARGV: group, consumer. Removes the consumer if it holds no entries.
LEAVE = """
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if p.err or p[1] then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""

# KEYS: queue. ARGV: group, idle ms, own name. Removes consumers that hold no entries and
# have not read for idle ms: workers that died (their entries were taken over).
PRUNE = """
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and f['idle'] > tonumber(ARGV[2]) and f['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed = removed + 1
  end
end
return removed
"""


@dataclass(frozen=True, slots=True)
class Entry:
    """One queue entry as delivered to this worker."""

    entry_id: str
    job_id: str | None  # None when the entry is garbage (no ``job`` field)
    raw: dict[str, str]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry of the dead-letter stream."""

    entry_id: str
    job_id: str
    reason: dict[str, Any]


class Queue:
    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._renew = redis.register_script(RENEW)
        self._settle = redis.register_script(SETTLE)
        self._leave = redis.register_script(LEAVE)
        self._prune = redis.register_script(PRUNE)
        self._claim_for_start = redis.register_script(CLAIM_FOR_START)
        self._take_over = redis.register_script(TAKE_OVER)
        self._reclaim_cursor = "0-0"

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists; from entry 0, so
        entries added before it are delivered too."""
        try:
            await self.redis.xgroup_create(self.keys.queue, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _recreate_group(self, exc: ResponseError) -> None:
        log.warning("the queue's consumer group is gone (%s); recreating it", exc)
        await self.ensure_group()
        self._reclaim_cursor = "0-0"

    async def add(self, job_id: str) -> str:
        return as_text(await self.redis.xadd(self.keys.queue, {"job": job_id}))

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries for this consumer; waits up to ``block_ms`` when there are none (None:
        does not wait). Recreates the group if it is gone (then returns nothing)."""
        try:
            reply: Any = await self.redis.xreadgroup(
                GROUP, self.consumer, {self.keys.queue: ">"}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            await self._recreate_group(exc)
            return []
        return [_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    async def reclaim(self, count: int, lease_ms: int) -> list[Entry]:
        """Entries whose owner stopped renewing them for longer than the lease.

        XAUTOCLAIM scans a window of the pending list per call; the cursor carries over
        between calls, so expired entries deep in a long pending list are found too.
        """
        try:
            reply: Any = await self.redis.xautoclaim(
                self.keys.queue, GROUP, self.consumer, lease_ms, self._reclaim_cursor, count=count
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            await self._recreate_group(exc)
            return []
        self._reclaim_cursor = as_text(reply[0])
        return [_entry(eid, fields) for eid, fields in reply[1] if fields is not None]

    async def renew(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of our entries; returns the ids another worker took."""
        if not entry_ids:
            return []
        lost = await self._renew(keys=[self.keys.queue], args=[GROUP, self.consumer, *entry_ids])
        return [as_text(x) for x in lost]

    async def claim_for_start(self, entry_id: str, lease_ms: int) -> int:
        """The entry's delivery count if it is ours and was delivered (or renewed) less than
        ``lease_ms`` ago, renewing it; 0 when it must not start (taken over, or a delivery a
        frozen process read late)."""
        args: list[str | int] = [GROUP, self.consumer, entry_id, lease_ms]
        return int(await self._claim_for_start(keys=[self.keys.queue], args=args))

    async def take_over(self, consumer: str, count: int) -> tuple[list[Entry], bool]:
        """Claim up to ``count`` entries of a dead consumer; also whether it holds no more."""
        args: list[str | int] = [GROUP, self.consumer, consumer, count]
        claimed, emptied = await self._take_over(keys=[self.keys.queue], args=args)
        entries = [_entry(row[0], _pairs(row[1])) for row in claimed if row and row[1]]
        return entries, int(emptied) == 1

    async def owned(self, max_idle_ms: int | None = None, count: int = 10_000) -> list[str]:
        """Ids of the entries this consumer holds, optionally only those idle < max_idle_ms."""
        rows = await self.redis.xpending_range(
            self.keys.queue, GROUP, min="-", max="+", count=count, consumername=self.consumer
        )
        return [
            as_text(row["message_id"])
            for row in rows
            if max_idle_ms is None or int(row["time_since_delivered"]) < max_idle_ms
        ]

    async def stranded(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Entries this consumer holds that nobody renewed for ``min_idle_ms``: delivered by
        a read whose reply was lost (Redis restarting), so the worker never saw them. They
        are claimed again (which renews them) and returned with their fields."""
        try:
            rows = await self.redis.xpending_range(
                self.keys.queue,
                GROUP,
                "-",
                "+",
                count,
                consumername=self.consumer,
                idle=min_idle_ms,
            )
        except ResponseError as exc:
            if not _no_group(exc):
                raise
            return []  # the next read recreates the group
        if not rows:
            return []
        ids: list[Any] = [as_text(row["message_id"]) for row in rows]
        claimed: Any = await self.redis.xclaim(
            self.keys.queue, GROUP, self.consumer, min_idle_ms, ids
        )
        return [_entry(eid, fields) for eid, fields in claimed if fields is not None]

    async def ack(self, entry_id: str) -> bool:
        """Ack and delete the entry if it is still ours (not taken over by another worker)."""
        args = [GROUP, self.consumer, entry_id, ""]
        return int(await self._settle(keys=[self.keys.queue], args=args)) != 0

    async def requeue(self, entry_id: str, job_id: str) -> str | None:
        """Hand a job back at once: a fresh entry replaces ours (None: it is not ours)."""
        args = [GROUP, self.consumer, entry_id, job_id]
        fresh = await self._settle(keys=[self.keys.queue], args=args)
        return None if fresh == 0 else as_text(fresh)

    async def job_of(self, entry_id: str) -> str | None:
        """The job id of an entry still in the stream."""
        rows: Any = await self.redis.xrange(self.keys.queue, entry_id, entry_id)
        return _entry(*rows[0]).job_id if rows else None

    async def leave(self) -> bool:
        """Remove this consumer from the group if it holds no entries (clean shutdown)."""
        result = await self._leave(keys=[self.keys.queue], args=[GROUP, self.consumer])
        return int(result) == 1

    async def prune(self, idle_ms: int) -> int:
        """Remove the consumers of dead workers (no entries, idle ``idle_ms``); how many."""
        args: list[str | int] = [GROUP, idle_ms, self.consumer]
        return int(await self._prune(keys=[self.keys.queue], args=args))

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


def _no_group(exc: ResponseError) -> bool:
    return str(exc).startswith("NOGROUP")


def _pairs(flat: Any) -> dict[Any, Any]:
    """A script's flat [field, value, ...] list as a dict (XCLAIM's entry fields)."""
    if isinstance(flat, dict):
        return flat
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _entry(entry_id: Any, fields: dict[Any, Any]) -> Entry:
    raw = {as_text(k): as_text(v) for k, v in fields.items()}
    return Entry(as_text(entry_id), raw.get("job"), raw)


def _dead(entry_id: Any, fields: dict[Any, Any]) -> DeadLetter:
    raw = {as_text(k): as_text(v) for k, v in fields.items()}
    try:
        reason: Any = json.loads(raw.get("reason") or "{}")
    except ValueError:
        reason = {"message": raw.get("reason", "")}
    return DeadLetter(
        as_text(entry_id), raw.get("job", ""), reason if isinstance(reason, dict) else {}
    )
