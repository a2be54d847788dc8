"""The job record and its events stream: every state change is one fenced Lua script.

A job's record (hash) and events stream share a hash tag, so each script touches one
Cluster slot. The fencing token is the record's ``attempt``: a write carries the attempt
that made it and is refused once a newer attempt started. Delta entries also carry a
per-attempt sequence number so a write retried after a lost reply is applied once.
See docs/redis.md for the data model.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from worker.keys import Keys

JSONish = dict[str, Any]

# KEYS: record, events. ARGV: field/value pairs of the new record, retention.
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HGET', KEYS[1], 'queue_entry') and 'exists' or 'unqueued'
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 'created'
"""

# KEYS: record, events. ARGV: worker, now, max_attempts, retention.
START = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'releases', 'request', 'upstream')
if not cur[1] then return {'missing'} end
if cur[1] ~= 'queued' and cur[1] ~= 'running' then return {'terminal'} end
local attempt = tonumber(cur[2] or '0') + 1
local releases = tonumber(cur[3] or '0')
if attempt - releases > tonumber(ARGV[3]) then
  local err = cjson.encode({code='attempts_exhausted',
    message='the job was started ' .. (attempt - 1 - releases) .. ' times without finishing'})
  redis.call('HSET', KEYS[1], 'status', 'failed', 'error', err, 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[2], '*', 'type', 'error', 'attempt', tostring(attempt - 1),
    'data', cjson.encode({error=cjson.decode(err)}))
  redis.call('EXPIRE', KEYS[1], ARGV[4]); redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {'exhausted', attempt - 1}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'attempt', attempt, 'worker', ARGV[1],
  'started_at', ARGV[2], 'seq', 0)
if attempt > 1 then
  redis.call('XADD', KEYS[2], '*', 'type', 'reset', 'attempt', tostring(attempt),
    'data', cjson.encode({reason='attempt ' .. attempt .. ' starts; earlier deltas are void'}))
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return {'started', attempt, cur[4] or '', cur[5] or 'default'}
"""

# KEYS: record, events. ARGV: attempt, seq, data, retention.
DELTA = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status', 'seq')
if cur[1] ~= ARGV[1] or cur[2] ~= 'running' then return -1 end
if tonumber(cur[3] or '0') >= tonumber(ARGV[2]) then return 0 end
redis.call('XADD', KEYS[2], '*', 'type', 'delta', 'attempt', ARGV[1], 'data', ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2])
if ARGV[2] == '1' then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
"""

# KEYS: record, events. ARGV: attempt, event type, event data, retention, field/value pairs.
FINISH = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if cur[1] ~= ARGV[1] then return -1 end
if cur[2] ~= 'running' then return (cur[2] == 'queued') and -1 or 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('XADD', KEYS[2], '*', 'type', ARGV[2], 'attempt', ARGV[1], 'data', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4]); redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""

# KEYS: record. ARGV: attempt. Gives a running attempt back to the queue (shutdown).
RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if cur[1] ~= ARGV[1] or cur[2] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 1
"""

# KEYS: record, events. ARGV: now, retention.
CANCEL = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if not cur[1] then return 'missing' end
if cur[1] == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  return 'requested'
end
if cur[1] ~= 'queued' then return cur[1] end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1], 'cancel_requested', '1')
redis.call('XADD', KEYS[2], '*', 'type', 'cancelled', 'attempt', cur[2] or '0', 'data', '{}')
redis.call('EXPIRE', KEYS[1], ARGV[2]); redis.call('EXPIRE', KEYS[2], ARGV[2])
return 'cancelled'
"""


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class Started:
    """The outcome of trying to start an attempt of a job."""

    state: str  # started | missing | terminal | exhausted
    attempt: int = 0
    request: str = ""
    upstream: str = "default"


class Records:
    """The fenced record/stream operations, as registered Lua scripts."""

    def __init__(self, redis: Redis, keys: Keys, retention_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.retention = retention_seconds
        self._create = redis.register_script(CREATE)
        self._start = redis.register_script(START)
        self.delta_script: AsyncScript = redis.register_script(DELTA)
        self.finish_script: AsyncScript = redis.register_script(FINISH)
        self._release = redis.register_script(RELEASE)
        self._cancel = redis.register_script(CANCEL)

    def job_keys(self, job_id: str) -> list[str]:
        return [self.keys.job(job_id), self.keys.events(job_id)]

    async def load_scripts(self) -> None:
        """Load the pipelined scripts (again after a Redis restart: NOSCRIPT)."""
        for script in (self.delta_script, self.finish_script):
            script.sha = as_text(await self.redis.script_load(script.script))

    def queue_delta(self, pipe: Any, job_id: str, attempt: int, seq: int, data: str) -> None:
        """Add one fenced delta write to a pipeline (EVALSHA: no per-batch SCRIPT EXISTS)."""
        args = (attempt, seq, data, self.retention)
        pipe.evalsha(self.delta_script.sha, 2, *self.job_keys(job_id), *args)

    def queue_finish(self, pipe: Any, job_id: str, attempt: int, args: list[Any]) -> None:
        pipe.evalsha(self.finish_script.sha, 2, *self.job_keys(job_id), attempt, *args)

    async def create(self, job_id: str, fields: dict[str, str]) -> str:
        """Create the record unless it exists: ``created``, ``exists`` or ``unqueued``."""
        flat = [item for pair in fields.items() for item in pair]
        result = await self._create(keys=self.job_keys(job_id), args=[self.retention, *flat])
        return as_text(result)

    async def mark_queued(self, job_id: str, entry_id: str) -> None:
        await self.redis.hset(self.keys.job(job_id), "queue_entry", entry_id)

    async def start(self, job_id: str, worker: str, max_attempts: int) -> Started:
        args: list[str | int] = [worker, f"{time.time():.6f}", max_attempts, self.retention]
        result = await self._start(keys=self.job_keys(job_id), args=args)
        state = as_text(result[0])
        if state == "started":
            return Started(state, int(result[1]), as_text(result[2]), as_text(result[3]))
        return Started(state, int(result[1]) if len(result) > 1 else 0)

    async def release(self, job_id: str, attempt: int) -> bool:
        return int(await self._release(keys=[self.keys.job(job_id)], args=[attempt])) == 1

    async def cancel(self, job_id: str) -> str:
        args: list[str | int] = [f"{time.time():.6f}", self.retention]
        return as_text(await self._cancel(keys=self.job_keys(job_id), args=args))

    async def fetch(self, job_id: str) -> dict[str, str]:
        raw: dict[Any, Any] = await self.redis.hgetall(self.keys.job(job_id))
        return {as_text(k): as_text(v) for k, v in raw.items()}


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
