"""The job queue: one Redis Stream read through the consumer group ``workers``.

An entry ``{job: <id>}`` stands for "run this job". A worker reads entries with
XREADGROUP (blocking, at most as many as it has free slots); the entry then sits in the
group's pending list, owned by that worker, until it is acked and deleted after the job's
terminal write. The entry's idle time is the lease: the owner renews it (XCLAIM of its own
entries), and an entry idle longer than the lease belongs to a dead worker and is taken
over by XAUTOCLAIM. Acks and hand-backs check ownership in the same script: a worker never
acks an entry another worker took over. The dead-letter stream lists jobs that exhausted
their attempts. See docs/reliability.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from worker.keys import GROUP, Keys
from worker.records import as_text, dumps

# KEYS: queue. ARGV: group, consumer, entry ids... Renews only the entries still ours.
RENEW = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
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
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not (p[1] and p[1][2] == ARGV[2]) then return 0 end
local fresh = 1
if ARGV[4] ~= '' then fresh = redis.call('XADD', KEYS[1], '*', 'job', ARGV[4]) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return fresh
"""

# KEYS: queue. ARGV: group, consumer. Removes the consumer if it holds no entries.
LEAVE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if p[1] then return 0 end
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
        self._reclaim_cursor = "0-0"

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.queue, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def add(self, job_id: str) -> str:
        return as_text(await self.redis.xadd(self.keys.queue, {"job": job_id}))

    async def read(self, count: int, block_ms: int) -> list[Entry]:
        """New entries for this consumer; waits up to ``block_ms`` when there are none."""
        reply: Any = await self.redis.xreadgroup(
            GROUP, self.consumer, {self.keys.queue: ">"}, count=count, block=block_ms
        )
        return [_entry(eid, fields) for _, entries in reply or [] for eid, fields in entries]

    async def reclaim(self, count: int, lease_ms: int) -> list[Entry]:
        """Entries whose owner stopped renewing them for longer than the lease.

        XAUTOCLAIM scans a window of the pending list per call; the cursor carries over
        between calls, so expired entries deep in a long pending list are found too.
        """
        reply: Any = await self.redis.xautoclaim(
            self.keys.queue, GROUP, self.consumer, lease_ms, self._reclaim_cursor, count=count
        )
        self._reclaim_cursor = as_text(reply[0])
        return [_entry(eid, fields) for eid, fields in reply[1] if fields is not None]

    async def renew(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of our entries; returns the ids another worker took."""
        if not entry_ids:
            return []
        lost = await self._renew(keys=[self.keys.queue], args=[GROUP, self.consumer, *entry_ids])
        return [as_text(x) for x in lost]

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
        rows = await self.redis.xpending_range(
            self.keys.queue, GROUP, "-", "+", count, consumername=self.consumer, idle=min_idle_ms
        )
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
