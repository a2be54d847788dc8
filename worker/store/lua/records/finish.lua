-- KEYS: record, events. ARGV: attempt, last seq, event type, event data, retention,
-- field/value pairs. The terminal write lands only after the attempt's last delta entry:
-- 1 written; 0 the job is already terminal (a retried write found its first one applied);
-- -1 stale; -2 not yet (a delta entry is missing: the caller sends it again first).
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status', 'seq')
if cur[1] ~= ARGV[1] then return -1 end
if cur[2] ~= 'running' then return (cur[2] == 'queued') and -1 or 0 end
if tonumber(cur[3] or '0') < tonumber(ARGV[2]) then return -2 end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('XADD', KEYS[2], '*', 'type', ARGV[3], 'attempt', ARGV[1], 'data', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5]); redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
