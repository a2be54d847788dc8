"""The job record and its events stream: every state change is one fenced Lua script.

A job's record (hash) and events stream share a hash tag, so each script touches one
Cluster slot. The fencing token is the record's ``attempt``: a write carries the attempt
that made it and is refused once a newer attempt started. Delta entries also carry a
per-attempt sequence number so a write retried after a lost reply is applied once.
See docs/redis.md for the data model.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript

from schemas.jobs import OUTPUT_FIELDS
from worker.store.batch import Command
from worker.store.keys import Keys
from worker.store.redis_client import RedisClient

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

# KEYS: record, events. ARGV: worker, now, max_attempts, retention, queue entry ('' = the
# attempt does not come from a queue entry: no duplicate check, the entry field is kept),
# delivery (the entry's delivery count; '' = unknown), start token (unique per call: the same
# call retried after a lost reply starts nothing new), restart of (an attempt number: a new
# attempt of the caller's own run, only while that attempt is current; '' otherwise).
# Attempts count against max_attempts since the last requeue (budget_base), minus releases.
# A start from the entry the job runs under is a takeover only with a newer delivery: an
# older one (a reply a frozen worker reads late) is 'superseded' and starts nothing.
START = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'releases', 'request', 'upstream',
  'entry', 'budget_base', 'dead_pending', 'start_token', 'cancel_requested', 'delivery')
if not cur[1] and redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local known = {queued=true, running=true, succeeded=true, failed=true, cancelled=true}
if not known[cur[1] or ''] or not tonumber(cur[2] or '0') then
  -- written by another producer, not by the enqueue contract: fail it, saying why
  local problem = cur[1] and ('status ' .. string.sub(cur[1], 1, 40) .. ' is not one of ' ..
    'queued, running, succeeded, failed, cancelled') or 'no status field'
  if known[cur[1] or ''] then problem = 'attempt is not a number' end
  local err = cjson.encode({code='invalid_job',
    message='malformed record: ' .. problem .. ' (see docs/producers.md)'})
  local attempt = tonumber(cur[2] or '0') or 0
  redis.call('HSET', KEYS[1], 'status', 'failed', 'attempt', attempt, 'error', err,
    'finished_at', ARGV[2])
  redis.call('XADD', KEYS[2], '*', 'type', 'error', 'attempt', tostring(attempt),
    'data', cjson.encode({error=cjson.decode(err)}))
  redis.call('EXPIRE', KEYS[1], ARGV[4]); redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {'invalid', attempt, '', cur[5] or 'default', err}
end
local attempt = tonumber(cur[2] or '0')
if cur[1] == 'running' and cur[9] == ARGV[7] then
  return {'started', attempt, cur[4] or '', cur[5] or 'default'}
end
if cur[1] ~= 'queued' and cur[1] ~= 'running' then
  return {'terminal', attempt, cur[8] or ''}
end
if cur[1] == 'queued' and cur[10] == '1' then
  -- cancelled while its attempt was being handed back (shutdown): it never restarts
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[2], '*', 'type', 'cancelled', 'attempt', tostring(attempt),
    'data', '{}')
  redis.call('EXPIRE', KEYS[1], ARGV[4]); redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {'terminal', attempt, ''}
end
if ARGV[8] ~= '' then
  if cur[1] ~= 'running' or tostring(attempt) ~= ARGV[8] then return {'superseded', attempt} end
elseif ARGV[5] ~= '' and cur[6] == ARGV[5] then
  if ARGV[6] ~= '' and tonumber(ARGV[6]) <= tonumber(cur[11] or '0') then
    return {'superseded', attempt}
  end
elseif ARGV[5] ~= '' and cur[1] == 'running' and cur[6] then
  return {'busy', attempt}
end
attempt = attempt + 1
local used = attempt - tonumber(cur[3] or '0') - tonumber(cur[7] or '0')
if used > tonumber(ARGV[3]) then
  local err = cjson.encode({code='attempts_exhausted',
    message='the job was started ' .. (used - 1) .. ' times without finishing'})
  redis.call('HSET', KEYS[1], 'status', 'failed', 'error', err, 'finished_at', ARGV[2],
    'dead_pending', '1')
  redis.call('XADD', KEYS[2], '*', 'type', 'error', 'attempt', tostring(attempt - 1),
    'data', cjson.encode({error=cjson.decode(err)}))
  redis.call('EXPIRE', KEYS[1], ARGV[4]); redis.call('EXPIRE', KEYS[2], ARGV[4])
  return {'exhausted', attempt - 1, '1', cur[5] or 'default', err}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'attempt', attempt, 'worker', ARGV[1],
  'started_at', ARGV[2], 'seq', 0, 'start_token', ARGV[7])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'entry', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'delivery', ARGV[6]) end
if attempt > 1 then
  redis.call('XADD', KEYS[2], '*', 'type', 'reset', 'attempt', tostring(attempt),
    'data', cjson.encode({reason='attempt ' .. attempt .. ' starts; earlier deltas are void'}))
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return {'started', attempt, cur[4] or '', cur[5] or 'default'}
"""

# Results of DELTA and FINISH, as the publisher reads them.
WRITTEN, ALREADY, STALE, NOT_YET = 1, 0, -1, -2

# KEYS: record, events. ARGV: attempt, seq, data, retention.
# Entries land in sequence order and never twice: 1 written; 0 this number was written before
# (a retry after a lost reply); -1 stale (not the current running attempt, or no record);
# -2 not yet (an earlier number is not written: the caller sends it again, then this one).
DELTA = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status', 'seq')
if cur[1] ~= ARGV[1] or cur[2] ~= 'running' then return -1 end
local last, seq = tonumber(cur[3] or '0'), tonumber(ARGV[2])
if seq <= last then return 0 end
if seq > last + 1 then return -2 end
redis.call('XADD', KEYS[2], '*', 'type', 'delta', 'attempt', ARGV[1], 'data', ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2])
if ARGV[2] == '1' then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
"""

# KEYS: record, events. ARGV: attempt, last seq, event type, event data, retention,
# field/value pairs. The terminal write lands only after the attempt's last delta entry:
# 1 written; 0 the job is already terminal (a retried write found its first one applied);
# -1 stale; -2 not yet (a delta entry is missing: the caller sends it again first).
FINISH = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status', 'seq')
if cur[1] ~= ARGV[1] then return -1 end
if cur[2] ~= 'running' then return (cur[2] == 'queued') and -1 or 0 end
if tonumber(cur[3] or '0') < tonumber(ARGV[2]) then return -2 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('XADD', KEYS[2], '*', 'type', ARGV[3], 'attempt', ARGV[1], 'data', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5]); redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""

# KEYS: record. ARGV: attempt. Gives a running attempt back to the queue (shutdown).
# Idempotent: a retry after a lost reply finds the job queued at the same attempt.
RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if cur[1] ~= ARGV[1] then return 0 end
if cur[2] == 'queued' then return 1 end
if cur[2] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 1
"""

# KEYS: record. ARGV: queue entry. Releases the attempt that runs under a queue entry this
# worker holds but no longer runs (a task that died, a start cut short by shutdown).
HANDBACK = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 1
"""

# KEYS: record. ARGV: attempt. After Redis lost writes of this attempt it had confirmed (a
# failover to a replica that lacked them), the record is behind: back to queued, with the
# attempt counter at least this attempt (so its writes stay fenced), this attempt not
# counted. 'queued'; 'newer' when a later attempt started since; else the status it has.
ROLLED_BACK = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if not cur[1] then return 'missing' end
if (tonumber(cur[2]) or 0) > tonumber(ARGV[1]) then return 'newer' end
if cur[1] ~= 'running' and cur[1] ~= 'queued' then return cur[1] end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '', 'attempt', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 'queued'
"""

# KEYS: record, events. ARGV: now, retention, the output fields (OUTPUT_FIELDS). A failed
# (dead-lettered) job back to queued with a fresh attempt budget; the attempt counter stays
# monotonic, so every write of an earlier attempt stays fenced. The old events stream (ended
# by its error entry) is void.
REQUEUE = """
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'releases', 'queue_entry')
if not cur[1] then return 'missing' end
if cur[1] == 'queued' then return cur[4] and 'queued' or 'unqueued' end
if cur[1] ~= 'failed' then return cur[1] end
local base = tonumber(cur[2] or '0') - tonumber(cur[3] or '0')
redis.call('HDEL', KEYS[1], 'error', 'finished_at', 'worker', 'entry', 'queue_entry',
  'dead_pending', 'dead_letter', 'cancel_requested', unpack(ARGV, 3))
redis.call('HSET', KEYS[1], 'status', 'queued', 'budget_base', base, 'requeued_at', ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 'requeued'
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


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII as is; one encoder for all calls (``json.dumps`` with
    options builds a new one per call: a tenth of the publisher's per-entry work)."""
    return _ENCODER.encode(value)


@dataclass(frozen=True, slots=True)
class Started:
    """The outcome of trying to start an attempt of a job."""

    state: str  # started | missing | terminal | busy | superseded | exhausted | invalid
    attempt: int = 0
    request: str = ""
    upstream: str = "default"
    dead_pending: bool = False  # failed for exhausted attempts, not yet on the dead stream
    error: str = ""  # exhausted | invalid: the error (JSON) the job failed with


class Records:
    """The fenced record/stream operations, as registered Lua scripts."""

    def __init__(self, redis: RedisClient, keys: Keys, retention_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.retention = retention_seconds
        self._create = redis.register_script(CREATE)
        self._start = redis.register_script(START)
        self.delta_script: AsyncScript = redis.register_script(DELTA)
        self.finish_script: AsyncScript = redis.register_script(FINISH)
        self._release = redis.register_script(RELEASE)
        self._handback = redis.register_script(HANDBACK)
        self._rolled_back = redis.register_script(ROLLED_BACK)
        self._requeue = redis.register_script(REQUEUE)
        self._cancel = redis.register_script(CANCEL)

    def job_keys(self, job_id: str) -> list[str]:
        return [self.keys.job(job_id), self.keys.events(job_id)]

    async def load_scripts(self) -> None:
        """Load the pipelined scripts (again after a Redis restart: NOSCRIPT)."""
        for script in (self.delta_script, self.finish_script):
            script.sha = as_text(await self.redis.script_load(script.script))

    def delta_command(self, job_id: str, attempt: int, seq: int, data: str) -> Command:
        """One fenced delta write (EVALSHA: no per-batch SCRIPT EXISTS)."""
        keys = self.job_keys(job_id)
        return ("EVALSHA", self.delta_script.sha, 2, *keys, attempt, seq, data, self.retention)

    def finish_command(self, job_id: str, attempt: int, last_seq: int, args: list[Any]) -> Command:
        """The fenced terminal write, after the attempt's delta ``last_seq``."""
        keys = self.job_keys(job_id)
        return ("EVALSHA", self.finish_script.sha, 2, *keys, attempt, last_seq, *args)

    async def create(self, job_id: str, fields: dict[str, str]) -> str:
        """Create the record unless it exists: ``created``, ``exists`` or ``unqueued``."""
        flat = [item for pair in fields.items() for item in pair]
        result = await self._create(keys=self.job_keys(job_id), args=[self.retention, *flat])
        return as_text(result)

    async def mark_queued(self, job_id: str, entry_id: str) -> None:
        await self.redis.hset(self.keys.job(job_id), "queue_entry", entry_id)

    async def start(
        self,
        job_id: str,
        worker: str,
        max_attempts: int,
        entry: str = "",
        token: str = "",
        *,
        delivery: int | None = None,
        restart_of: int | None = None,
    ) -> Started:
        """Start the next attempt (fenced: every earlier attempt's writes are refused).

        ``entry`` is the queue entry the attempt runs under: while the job runs under
        another entry, a duplicate entry is refused (``busy``), so at most one attempt runs.
        ``delivery`` is that entry's delivery count: a start from the entry the job already
        runs under is a takeover only with a higher count, else ``superseded`` (a stale
        delivery never replaces a live attempt). ``restart_of`` starts a new attempt of the
        caller's own run, only while that attempt is current (else ``superseded``).
        ``token`` identifies this start: pass the same one when retrying it after an error
        (the reply may have been lost after the start happened) to get the same attempt.
        """
        now, token = f"{time.time():.6f}", token or secrets.token_hex(8)
        args: list[str | int] = [
            worker,
            now,
            max_attempts,
            self.retention,
            entry,
            "" if delivery is None else delivery,
            token,
            "" if restart_of is None else restart_of,
        ]
        result = await self._start(keys=self.job_keys(job_id), args=args)
        state = as_text(result[0])
        if state == "started":
            return Started(state, int(result[1]), as_text(result[2]), as_text(result[3]))
        attempt = int(result[1]) if len(result) > 1 else 0
        dead_pending = len(result) > 2 and as_text(result[2]) == "1"
        if len(result) > 4:  # failed here: exhausted | invalid
            upstream, error = as_text(result[3]), as_text(result[4])
            return Started(state, attempt, "", upstream, dead_pending, error)
        return Started(state, attempt, dead_pending=dead_pending)

    async def release(self, job_id: str, attempt: int) -> bool:
        """Give a running attempt back (status queued); False when it is not current."""
        return int(await self._release(keys=[self.keys.job(job_id)], args=[attempt])) == 1

    async def rolled_back(self, job_id: str, attempt: int) -> str:
        """Queue the job again after Redis lost writes of ``attempt`` (see ROLLED_BACK)."""
        return as_text(await self._rolled_back(keys=[self.keys.job(job_id)], args=[attempt]))

    async def hand_back(self, job_id: str, entry: str) -> bool:
        """Release whatever attempt runs under ``entry`` (no live task runs it)."""
        return int(await self._handback(keys=[self.keys.job(job_id)], args=[entry])) == 1

    async def requeue(self, job_id: str) -> str:
        """A failed job back to ``queued`` with a fresh attempt budget.

        Returns ``requeued`` or ``unqueued`` (the caller adds a queue entry), ``queued``
        (it already is), ``missing``, or the job's other status (refused).
        """
        args: list[str | int] = [f"{time.time():.6f}", self.retention, *OUTPUT_FIELDS]
        return as_text(await self._requeue(keys=self.job_keys(job_id), args=args))

    async def dead_lettered(self, job_id: str, dead_entry: str) -> None:
        """The job is on the dead-letter stream (entry ``dead_entry``)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hdel(self.keys.job(job_id), "dead_pending")
        pipe.hset(self.keys.job(job_id), "dead_letter", dead_entry)
        await pipe.execute()

    async def closing_state(self, job_id: str) -> tuple[str, bool, int]:
        """(status, dead_pending, attempt) of the record: what is left to do for its queue
        entry."""
        fields = ["status", "dead_pending", "attempt"]
        status, pending, attempt = await self.redis.hmget(self.keys.job(job_id), fields)
        status = as_text(status) if status is not None else "missing"
        number = as_text(attempt) if attempt is not None else ""
        return status, pending is not None, int(number) if number.isdigit() else 0

    async def cancel(self, job_id: str) -> str:
        args: list[str | int] = [f"{time.time():.6f}", self.retention]
        return as_text(await self._cancel(keys=self.job_keys(job_id), args=args))

    async def cancel_requested(self, job_ids: list[str]) -> list[bool]:
        """Whether a cancel was requested for each job (one pipelined round trip); the
        fallback for a pub/sub cancel message a worker missed."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel_requested")
        flags = await pipe.execute()
        return [flag is not None and as_text(flag) == "1" for flag in flags]

    async def fetch(self, job_id: str) -> dict[str, str]:
        raw: dict[Any, Any] = await self.redis.hgetall(self.keys.job(job_id))
        return {as_text(k): as_text(v) for k, v in raw.items()}


def as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
