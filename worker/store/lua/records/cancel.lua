-- KEYS: record, events. ARGV: now, retention.
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
