-- KEYS: queue, scheduler prefix. ARGV: the producer's own bound on waiting jobs per tenant
-- on this shard (0: none; the stricter of it and the workers' applies), then six values per
-- job: job id, tenant, priority rank (0 high, 1 normal, 2 low), upstream, prompt tokens (an
-- estimate), max tokens ('' = none).
-- Each job in turn into its tenant's queue, then, if no entry waits in the stream for a
-- reader, the fairest waiting job into the stream (a worker blocked reading it takes it at
-- once): as many calls of one job each would do. Returns one reply per job: {'queued'}, {'exists'} (it waits already: enqueueing
-- it again is a no-op) or {'full', waiting} (the tenant has that many waiting: nothing of
-- that job was written).
local function push(c, j, t, rank, u, prompt, max, bound, now)
  if redis.call('HEXISTS', S .. ':jobs', j) == 1 then return {'exists'} end
  local waiting = tonumber(redis.call('HGET', S .. ':counts', 't:' .. t) or '0')
  if bound > 0 and waiting >= bound then return {'full', waiting} end
  local seq = redis.call('HINCRBY', S .. ':counts', 'seq', 1)
  redis.call('ZADD', S .. ':q:' .. t .. ':' .. u, rank * 1e13 + seq, j)
  redis.call('HSET', S .. ':jobs', j, table.concat({t, u, prompt, max, now}, '|'))
  redis.call('SADD', S .. ':tu:' .. t, u)
  redis.call('HINCRBY', S .. ':counts', 'waiting', 1)
  redis.call('HINCRBY', S .. ':counts', 't:' .. t, 1)
  redis.call('HINCRBY', S .. ':counts', 'u:' .. u, 1)
  if not redis.call('ZSCORE', S .. ':tenants', t) then join(t) end
  wake(c, now)
  return {'queued'}
end

local c = load_config()
local bound = c.max_queued
local own = tonumber(ARGV[1]) or 0
if own > 0 and (bound == 0 or own < bound) then bound = own end
local now = now_ms()
local replies = {}
for i = 2, #ARGV, 6 do
  local rank = tonumber(ARGV[i + 2])
  replies[#replies + 1] = push(c, ARGV[i], ARGV[i + 1], rank, ARGV[i + 3], ARGV[i + 4],
                               ARGV[i + 5], bound, now)
end
return replies
