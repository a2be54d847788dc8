-- KEYS: record. ARGV: attempt. Gives a running attempt back to the queue (shutdown).
-- Idempotent: a retry after a lost reply finds the job queued at the same attempt.
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if cur[1] ~= ARGV[1] then return 0 end
if cur[2] == 'queued' then return 1 end
if cur[2] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 1
