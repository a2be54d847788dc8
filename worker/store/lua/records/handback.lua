-- KEYS: record. ARGV: queue entry. Releases the attempt that runs under a queue entry this
-- worker holds but no longer runs (a task that died, a start cut short by shutdown).
local cur = redis.call('HMGET', KEYS[1], 'status', 'entry')
if cur[1] ~= 'running' or cur[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 1
