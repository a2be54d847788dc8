-- The fair scheduler of one queue shard: the functions every scheduler script shares (this
-- file, sched/routes.lua and sched/dispatch.lua are prepended to each of them, in that
-- order). docs/decisions.md, 48, says why it is built so.
--
-- KEYS[1] is the shard's stream (the queue), KEYS[2] the shard's scheduler prefix
-- '<p>:sched:{<tag>}': every other key below starts with it, so each script touches one
-- Cluster slot (the stream's). Keys under S:
--   config          hash: u:<upstream> = 'conc|rpm|tpm' (empty: unlimited), w:<tenant> =
--                   weight, r:<route> = its targets (sched/routes.lua), lease_ms, est
--                   (completion tokens assumed without max_tokens),
--                   max_queued (per tenant on this shard; 0: unbounded), burst_ms (the
--                   requests per minute a burst may take at once, as ms of the rate);
--                   written by workers
--   tenants         zset: tenant -> pass (virtual time), the tenants with waiting jobs
--   left            zset: tenant -> its pass when its last waiting job left, while that is
--                   ahead of vtime (it rejoins at no less); the LEFT_MAX highest at most
--   tu:<t>          set: the upstreams (or routes) tenant t has waiting jobs for
--   q:<t>:<u>       zset: job id -> priority rank * 1e13 + arrival number (FIFO per rank)
--   jobs            hash: job id -> 'tenant|upstream|prompt tokens|max tokens|enqueued ms'
--                   of every waiting job (the upstream may be a route's name)
--   counts          hash: seq, vtime, waiting, t:<tenant> and u:<upstream> waiting counts
--                   (a field is deleted when its count is back to 0)
--   permits:<u>     zset: entry id -> last renewal (ms): the jobs of u out of the queue
--   rpm:<u>         zset: request number -> time (ms), the last minute's requests to u
--   gcra:<u>        string: when u's next request is due at the steady rate (ms; GCRA)
--   tpm:<u>         zset: entry id -> time (ms); tpmt:<u> hash: entry id -> tokens, total
--   cool:<u>        string with a TTL: u answered 429; nothing is sent to it until it expires
--   paused          hash: u -> when an operator paused it (ms); nothing is sent to it until
--                   resumed (sched/pause.lua)
local K, S = KEYS[1], KEYS[2]
local GROUP = 'workers'
local MINUTE = 60000
local SCAN = 64  -- tenants looked at per pick, in pass order
local LEFT_MAX = 10000  -- tenants remembered after their last job left

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(v)
  if v == nil or v == false or v == '' then return nil end
  return tonumber(v)
end

local function load_config()
  local flat = redis.call('HGETALL', S .. ':config')
  local c = {limits = {}, weights = {}, routes = {}, lease_ms = 30000, est = 1024,
    max_queued = 0, burst_ms = 500}
  c.paused = {}
  for _, u in ipairs(redis.call('HKEYS', S .. ':paused')) do c.paused[u] = true end
  for i = 1, #flat, 2 do
    local f, v = flat[i], flat[i + 1]
    local kind, name = string.sub(f, 1, 2), string.sub(f, 3)
    if kind == 'u:' then
      local conc, rpm, tpm = string.match(v, '^(%d*)|(%d*)|(%d*)$')
      c.limits[name] = {conc = num(conc), rpm = num(rpm), tpm = num(tpm)}
    elseif kind == 'w:' then
      c.weights[name] = num(v)
    elseif kind == 'r:' then
      c.routes[name] = cjson.decode(v)
    elseif f == 'lease_ms' or f == 'est' or f == 'max_queued' or f == 'burst_ms' then
      c[f] = num(v) or c[f]
    end
  end
  return c
end

-- Entries of the stream no consumer was given yet (acked entries are deleted, so the
-- stream holds the pending list and the undelivered entries).
local function undelivered()
  local len = redis.call('XLEN', K)
  if len == 0 then return 0 end
  local p = redis.pcall('XPENDING', K, GROUP)
  if type(p) ~= 'table' or p.err then return len end
  return len - p[1]
end

-- How many of tenant t's jobs wait in the stream for a reader (a wake-up moved them there:
-- at most a few), so that a bound on a tenant's waiting jobs counts them too.
local function undelivered_of(t)
  if undelivered() == 0 then return 0 end
  local last
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', K)) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == GROUP then last = f['last-delivered-id'] end
  end
  local found = 0
  for _, row in ipairs(redis.call('XRANGE', K, '(' .. (last or '0-0'), '+')) do
    local fields = row[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'tenant' and fields[i + 1] == t then found = found + 1 end
    end
  end
  return found
end

local function split(info)
  local t, u, prompt, max = string.match(info, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)')
  return t, u, tonumber(prompt) or 0, num(max)
end

local function tpm_purge(u, now)
  local key, totals = S .. ':tpm:' .. u, S .. ':tpmt:' .. u
  local old = redis.call('ZRANGEBYSCORE', key, '-inf', now - MINUTE)
  for _, m in ipairs(old) do
    local spent = tonumber(redis.call('HGET', totals, m) or '0')
    redis.call('HINCRBY', totals, 'total', -spent)
    redis.call('HDEL', totals, m)
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', now - MINUTE) end
  return tonumber(redis.call('HGET', totals, 'total') or '0')
end

-- ms until the minute's tokens leave room for `tokens` more (walks the oldest reservations)
local function tpm_wait(u, total, tokens, limit, now)
  local rows = redis.call('ZRANGE', S .. ':tpm:' .. u, 0, 99, 'WITHSCORES')
  local freed = 0
  for i = 1, #rows, 2 do
    freed = freed + tonumber(redis.call('HGET', S .. ':tpmt:' .. u, rows[i]) or '0')
    if total - freed + tokens <= limit then
      return math.max(1, tonumber(rows[i + 1]) + MINUTE - now)
    end
  end
  return MINUTE
end

-- The steady rate of u's requests (GCRA): the ms between two of them, and how far ahead of
-- it a burst may run (at least one request at a time; burst_ms of the rate at most).
local function gcra_params(c, lim)
  local interval = MINUTE / lim.rpm
  local burst = math.max(1, math.floor(c.burst_ms / interval))
  return interval, (burst - 1) * interval
end

-- 0 while upstream u may be sent a request now: the last 60 s hold fewer than its requests
-- per minute, and the requests are spread over the minute (a burst of at most burst_ms of
-- the rate); else the ms until one may go.
local function rpm_wait(c, lim, u, now)
  if not lim.rpm then return 0 end
  local key = S .. ':rpm:' .. u
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - MINUTE)
  if redis.call('ZCARD', key) >= lim.rpm then
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    return math.max(1, tonumber(oldest[2]) + MINUTE - now)
  end
  local _, tolerance = gcra_params(c, lim)
  local due = tonumber(redis.call('GET', S .. ':gcra:' .. u) or '0')
  return math.max(0, math.ceil(due - tolerance - now))
end

-- 0 when upstream u admits a call of `tokens` tokens now; else how long until a time-bound
-- limit may admit it (ms), or -1 while all its permits are held (a settle frees one) or an
-- operator paused it (its resume wakes the queue).
local function blocked(c, u, tokens, now)
  if c.paused[u] then return -1 end
  local lim = c.limits[u]
  if not lim then return 0 end
  local cool = redis.call('PTTL', S .. ':cool:' .. u)
  if cool > 0 then return cool end
  if lim.conc then
    local key = S .. ':permits:' .. u
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - c.lease_ms)
    if redis.call('ZCARD', key) >= lim.conc then return -1 end
  end
  local rpm = rpm_wait(c, lim, u, now)
  if rpm > 0 then return rpm end
  if lim.tpm then
    local total = tpm_purge(u, now)
    if total > 0 and total + tokens > lim.tpm then
      return tpm_wait(u, total, tokens, lim.tpm, now)
    end
  end
  return 0
end

local function take_request(c, u, now)
  local lim = c.limits[u]
  if lim and lim.rpm then
    local n = redis.call('HINCRBY', S .. ':counts', 'rq', 1)
    redis.call('ZADD', S .. ':rpm:' .. u, now, n)
    redis.call('PEXPIRE', S .. ':rpm:' .. u, MINUTE * 2)
    local interval = gcra_params(c, lim)
    local key = S .. ':gcra:' .. u
    local due = math.max(tonumber(redis.call('GET', key) or '0'), now) + interval
    redis.call('SET', key, string.format('%.0f', due), 'PX', math.ceil(due - now) + MINUTE)
  end
end

-- The permit (and the minute's request and tokens) of a job that leaves the queue as `entry`.
local function take(c, u, tokens, entry, now)
  local lim = c.limits[u]
  if not lim then return end
  if lim.conc then redis.call('ZADD', S .. ':permits:' .. u, now, entry) end
  take_request(c, u, now)
  if lim.tpm then
    redis.call('ZADD', S .. ':tpm:' .. u, now, entry)
    redis.call('HSET', S .. ':tpmt:' .. u, entry, tokens)
    redis.call('HINCRBY', S .. ':tpmt:' .. u, 'total', tokens)
  end
end

-- What `entry` holds of upstream u: its permit and its reserved tokens (a worker moved the
-- job to another upstream). The request it made stays counted: it was sent.
local function release(u, entry)
  redis.call('ZREM', S .. ':permits:' .. u, entry)
  local totals = S .. ':tpmt:' .. u
  local reserved = redis.call('HGET', totals, entry)
  if reserved then
    redis.call('HINCRBY', totals, 'total', -tonumber(reserved))
    redis.call('HDEL', totals, entry)
    redis.call('ZREM', S .. ':tpm:' .. u, entry)
  end
end

