-- KEYS: record, events. ARGV: worker, now, max_attempts, retention, queue entry ('' = the
-- attempt does not come from a queue entry: no duplicate check, the entry field is kept),
-- delivery (the entry's delivery count; '' = unknown), start token (unique per call: the same
-- call retried after a lost reply starts nothing new), restart of (an attempt number: a new
-- attempt of the caller's own run, only while that attempt is current; '' otherwise),
-- dispatched at (when the entry left its tenant's queue, Unix seconds; '' = not known: kept
-- from the first start), the reset entry's detail (a JSON object of fields it adds, or '').
-- Attempts count against max_attempts since the last requeue (budget_base), minus releases.
-- A start from the entry the job runs under is a takeover only with a newer delivery: an
-- older one (a reply a frozen worker reads late) is 'superseded' and starts nothing.
-- 'started' also returns the record's created_at and the W3C trace context stored with it.
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'releases', 'request', 'upstream',
  'entry', 'budget_base', 'dead_pending', 'start_token', 'cancel_requested', 'delivery',
  'created_at', 'traceparent', 'tracestate', 'baggage')
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
local origin = {cur[12] or '', cur[13] or '', cur[14] or '', cur[15] or ''}
if cur[1] == 'running' and cur[9] == ARGV[7] then
  return {'started', attempt, cur[4] or '', cur[5] or 'default', unpack(origin)}
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
if ARGV[9] and ARGV[9] ~= '' then redis.call('HSETNX', KEYS[1], 'dispatched_at', ARGV[9]) end
if attempt > 1 then
  local data = {reason='attempt ' .. attempt .. ' starts; earlier deltas are void'}
  if ARGV[10] and ARGV[10] ~= '' then
    for k, v in pairs(cjson.decode(ARGV[10])) do
      if k ~= 'reason' then data[k] = v end
    end
  end
  redis.call('XADD', KEYS[2], '*', 'type', 'reset', 'attempt', tostring(attempt),
    'data', cjson.encode(data))
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return {'started', attempt, cur[4] or '', cur[5] or 'default', unpack(origin)}
