-- KEYS: queue, scheduler prefix. ARGV: the producer's own bound on waiting jobs per tenant
-- on this shard (0: none; the stricter of it and the workers' applies), then six values per
-- job: job id, tenant, priority rank (0 high, 1 normal, 2 low), upstream, prompt tokens (an
-- estimate), max tokens ('' = none).
-- Each job in turn into its tenant's queue, then, if no entry waits in the stream for a
-- reader, the fairest waiting job into the stream (a worker blocked reading it takes it at
-- once): as many calls of one job each would do. Returns one reply per job: {'queued'},
-- {'exists'} (it waits already: enqueueing it again is a no-op) or {'full', waiting} (the
-- tenant has that many waiting: nothing of that job was written). A tenant's waiting jobs
-- are those in its queues and those a wake-up moved into the stream that no worker read yet.
--
-- Within a call, what does not change is not asked again: the tenants' waiting counts,
-- their upstreams and places in the tenants' order are kept here (and forgotten whenever a
-- dispatch may have changed them), and the counts' increments are written once at the end.
-- Once an entry waits in the stream nothing is dispatched any more in this call (nobody
-- reads the stream while a script runs), so from then on a job costs four calls.
local c = load_config()
local bound = c.max_queued
local own = tonumber(ARGV[1]) or 0
if own > 0 and (bound == 0 or own < bound) then bound = own end
local now = now_ms()
local counts = S .. ':counts'
local waiting_of, listed, joined = {}, {}, {}
local added = {}  -- counts field -> increment not written yet
local fed = false  -- an entry waits in the stream for a reader

local function add(field)
  added[field] = (added[field] or 0) + 1
end

local function flush()
  for field, n in pairs(added) do redis.call('HINCRBY', counts, field, n) end
  added = {}
end

local function listed_once(t, u)
  local of_t = listed[t]
  if of_t == nil then
    of_t = {}
    listed[t] = of_t
  end
  if not of_t[u] then
    redis.call('SADD', S .. ':tu:' .. t, u)
    of_t[u] = true
  end
end

local function push(j, t, rank, u, prompt, max)
  if redis.call('HEXISTS', S .. ':jobs', j) == 1 then return {'exists'} end
  local waiting = waiting_of[t]
  if waiting == nil then
    waiting = tonumber(redis.call('HGET', counts, 't:' .. t) or '0')
    if bound > 0 then waiting = waiting + undelivered_of(t) end
  end
  waiting_of[t] = waiting
  if bound > 0 and waiting >= bound then return {'full', waiting} end
  local seq = redis.call('HINCRBY', counts, 'seq', 1)
  redis.call('ZADD', S .. ':q:' .. t .. ':' .. u, rank * 1e13 + seq, j)
  redis.call('HSET', S .. ':jobs', j, table.concat({t, u, prompt, max, now}, '|'))
  listed_once(t, u)
  add('waiting')
  add('t:' .. t)
  add('u:' .. u)
  waiting_of[t] = waiting + 1
  if not joined[t] then
    if not redis.call('ZSCORE', S .. ':tenants', t) then join(t) end
    joined[t] = true
  end
  if not fed then
    flush()
    wake(c, now)
    fed = undelivered() > 0
    waiting_of, listed, joined = {}, {}, {}
  end
  return {'queued'}
end

local replies = {}
for i = 2, #ARGV, 6 do
  local rank = tonumber(ARGV[i + 2])
  replies[#replies + 1] = push(ARGV[i], ARGV[i + 1], rank, ARGV[i + 3], ARGV[i + 4], ARGV[i + 5])
end
flush()
return replies
