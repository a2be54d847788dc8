-- KEYS: queue, scheduler prefix. ARGV: job id, tenant, priority rank (0 high, 1 normal,
-- 2 low), upstream, prompt tokens (an estimate), max tokens ('' = none), the producer's own
-- bound on waiting jobs per tenant on this shard (0: none; the stricter of it and the
-- workers' applies).
-- A job into its tenant's queue; then, if no entry waits in the stream for a reader, the
-- fairest waiting job into the stream (a worker blocked reading it takes it at once).
-- Returns {'queued'}, {'exists'} (it waits already: enqueueing it again is a no-op) or
-- {'full', waiting} (the tenant has that many waiting: nothing was written).
local j, t, rank, u = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
if redis.call('HEXISTS', S .. ':jobs', j) == 1 then return {'exists'} end
local c = load_config()
local bound = c.max_queued
local own = tonumber(ARGV[7]) or 0
if own > 0 and (bound == 0 or own < bound) then bound = own end
local waiting = tonumber(redis.call('HGET', S .. ':counts', 't:' .. t) or '0')
if bound > 0 and waiting >= bound then return {'full', waiting} end
local seq = redis.call('HINCRBY', S .. ':counts', 'seq', 1)
redis.call('ZADD', S .. ':q:' .. t .. ':' .. u, rank * 1e13 + seq, j)
local info = table.concat({t, u, ARGV[5], ARGV[6], now_ms()}, '|')
redis.call('HSET', S .. ':jobs', j, info)
redis.call('SADD', S .. ':tu:' .. t, u)
redis.call('HINCRBY', S .. ':counts', 'waiting', 1)
redis.call('HINCRBY', S .. ':counts', 't:' .. t, 1)
redis.call('HINCRBY', S .. ':counts', 'u:' .. u, 1)
if not redis.call('ZSCORE', S .. ':tenants', t) then join(t) end
wake(c, now_ms())
return {'queued'}
