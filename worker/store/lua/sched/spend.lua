-- KEYS: queue, scheduler prefix. ARGV: upstream, entry id, tokens. The tokens a job really
-- used (its usage), in place of what was reserved when it left the queue.
local totals = S .. ':tpmt:' .. ARGV[1]
local reserved = redis.call('HGET', totals, ARGV[2])
if not reserved then return 0 end
redis.call('HSET', totals, ARGV[2], ARGV[3])
redis.call('HINCRBY', totals, 'total', tonumber(ARGV[3]) - tonumber(reserved))
return 1
