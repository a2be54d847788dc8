-- KEYS: record, events. ARGV: attempt, type, data, retention.
-- A progress entry of the running attempt (``waiting``): no sequence number, since it is
-- written only before the attempt's first delta. Returns 1 written, -1 stale (not the
-- current running attempt, or no record).
local cur = redis.call('HMGET', KEYS[1], 'attempt', 'status')
if cur[1] ~= ARGV[1] or cur[2] ~= 'running' then return -1 end
redis.call('XADD', KEYS[2], '*', 'type', ARGV[2], 'attempt', ARGV[1], 'data', ARGV[3])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
