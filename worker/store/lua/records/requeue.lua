-- KEYS: record, events. ARGV: now, retention, the output fields (OUTPUT_FIELDS and
-- SERVED_FIELDS). A failed (dead-lettered) job back to queued with a fresh attempt budget; the attempt counter stays
-- monotonic, so every write of an earlier attempt stays fenced. The old events stream (ended
-- by its error entry) is void.
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
