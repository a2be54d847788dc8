"""The job queue: one Redis Stream read through the consumer group ``workers``.

An entry ``{job: <id>}`` stands for "run this job". A worker reads entries with
XREADGROUP (blocking, at most as many as it has free slots); the entry then sits in the
group's pending list, owned by that worker, until it is acked and deleted after the job's
terminal write. The entry's idle time is the lease: the owner renews it (XCLAIM of its own
entries), and an entry idle longer than the lease belongs to a dead worker and is taken
over by XAUTOCLAIM.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Entry:
    """One queue entry as delivered to this worker."""

    entry_id: str
    job_id: str | None  # None when the entry is garbage (no ``job`` field)
    raw: dict[str, str]


class Queue:
    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._renew = redis.register_script(RENEW)

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
        """Entries whose owner stopped renewing them for longer than the lease."""
        reply: Any = await self.redis.xautoclaim(
            self.keys.queue, GROUP, self.consumer, lease_ms, "0-0", count=count
        )
        return [_entry(eid, fields) for eid, fields in reply[1] if fields is not None]

    async def renew(self, entry_ids: list[str]) -> list[str]:
        """Reset the idle time of our entries; returns the ids another worker took."""
        if not entry_ids:
            return []
        lost = await self._renew(keys=[self.keys.queue], args=[GROUP, self.consumer, *entry_ids])
        return [as_text(x) for x in lost]

    async def owned(self, count: int = 10_000) -> list[str]:
        """Ids of the entries this consumer holds in the pending list."""
        rows = await self.redis.xpending_range(
            self.keys.queue, GROUP, min="-", max="+", count=count, consumername=self.consumer
        )
        return [as_text(row["message_id"]) for row in rows]

    async def ack(self, entry_id: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.keys.queue, GROUP, entry_id)
        pipe.xdel(self.keys.queue, entry_id)
        await pipe.execute()

    async def requeue(self, entry_id: str, job_id: str) -> None:
        """Hand a job back at once (shutdown): a fresh entry replaces ours."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.queue, {"job": job_id})
        pipe.xack(self.keys.queue, GROUP, entry_id)
        pipe.xdel(self.keys.queue, entry_id)
        await pipe.execute()

    async def requeue_owned(self, entry_id: str) -> None:
        """Hand back an entry we hold but never started (its job id read from the stream)."""
        rows: Any = await self.redis.xrange(self.keys.queue, entry_id, entry_id)
        job_id = _entry(*rows[0]).job_id if rows else None
        if job_id is None:
            await self.ack(entry_id)
        else:
            await self.requeue(entry_id, job_id)

    async def dead_letter(self, job_id: str, reason: dict[str, Any]) -> None:
        await self.redis.xadd(self.keys.dead, {"job": job_id, "reason": dumps(reason)})


def _entry(entry_id: Any, fields: dict[Any, Any]) -> Entry:
    raw = {as_text(k): as_text(v) for k, v in fields.items()}
    return Entry(as_text(entry_id), raw.get("job"), raw)
