-- KEYS: record, events. ARGV: attempt, seq, data, retention.
-- Entries land in sequence order and never twice: 1 written; 0 this number was written before
-- (a retry after a lost reply); -1 stale (not the current running attempt, or no record);
-- -2 not yet (an earlier number is not written: the caller sends it again, then this one).
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status', 'seq')
if cur[1] ~= ARGV[1] or cur[2] ~= 'running' then return -1 end
local last, seq = tonumber(cur[3] or '0'), tonumber(ARGV[2])
if seq <= last then return 0 end
if seq > last + 1 then return -2 end
redis.call('XADD', KEYS[2], '*', 'type', 'delta', 'attempt', ARGV[1], 'data', ARGV[3])
redis.call('HSET', KEYS[1], 'seq', ARGV[2])
if ARGV[2] == '1' then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
