-- KEYS: record. ARGV: attempt. After Redis lost writes of this attempt it had confirmed (a
-- failover to a replica that lacked them), the record is behind: back to queued, with the
-- attempt counter at least this attempt (so its writes stay fenced), this attempt not
-- counted. 'queued'; 'newer' when a later attempt started since; else the status it has.
local cur = redis.call('HMGET', KEYS[1], 'status', 'attempt')
if not cur[1] then return 'missing' end
if (tonumber(cur[2]) or 0) > tonumber(ARGV[1]) then return 'newer' end
if cur[1] ~= 'running' and cur[1] ~= 'queued' then return cur[1] end
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '', 'attempt', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'releases', 1)
return 'queued'
