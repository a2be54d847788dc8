-- The fair scheduler of one queue shard: the functions every scheduler script shares (this
-- file is prepended to each of them). docs/decisions.md, 48, says why it is built so.
--
-- KEYS[1] is the shard's stream (the queue), KEYS[2] the shard's scheduler prefix
-- '<p>:sched:{<tag>}': every other key below starts with it, so each script touches one
-- Cluster slot (the stream's). Keys under S:
--   config          hash: u:<upstream> = 'conc|rpm|tpm' (empty: unlimited), w:<tenant> =
--                   weight, lease_ms, est (completion tokens assumed without max_tokens),
--                   max_queued (per tenant on this shard; 0: unbounded); written by workers
--   tenants         zset: tenant -> pass (virtual time), the tenants with waiting jobs
--   last            hash: tenant -> its pass when its last waiting job left (it rejoins at
--                   no less; emptied when it grows past LAST_MAX)
--   tu:<t>          set: the upstreams tenant t has waiting jobs for
--   q:<t>:<u>       zset: job id -> priority rank * 1e13 + arrival number (FIFO per rank)
--   jobs            hash: job id -> 'tenant|upstream|prompt tokens|max tokens|enqueued ms'
--                   of every waiting job
--   counts          hash: seq, vtime, waiting, t:<tenant> and u:<upstream> waiting counts
--   permits:<u>     zset: entry id -> last renewal (ms): the jobs of u out of the queue
--   rpm:<u>         zset: request number -> time (ms), the last minute's requests to u
--   tpm:<u>         zset: entry id -> time (ms); tpmt:<u> hash: entry id -> tokens, total
--   cool:<u>        string with a TTL: u answered 429; nothing is sent to it until it expires
--   paused          hash: u -> when an operator paused it (ms); nothing is sent to it until
--                   resumed (sched/pause.lua)
local K, S = KEYS[1], KEYS[2]
local GROUP = 'workers'
local MINUTE = 60000
local SCAN = 64  -- tenants looked at per pick, in pass order
local LAST_MAX = 10000  -- tenants remembered after their last job left

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
  local c = {limits = {}, weights = {}, lease_ms = 30000, est = 1024, max_queued = 0}
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
    elseif f == 'lease_ms' or f == 'est' or f == 'max_queued' then
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

-- 0 while upstream u has requests left in the last minute's budget (or no such limit);
-- else the ms until its oldest request of the minute expires.
local function rpm_wait(lim, u, now)
  if not lim.rpm then return 0 end
  local key = S .. ':rpm:' .. u
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - MINUTE)
  if redis.call('ZCARD', key) < lim.rpm then return 0 end
  local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return math.max(1, tonumber(oldest[2]) + MINUTE - now)
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
  local rpm = rpm_wait(lim, u, now)
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

-- The head of tenant t's queue for each upstream it waits on: the best one that may be sent
-- now (lowest score: priority, then arrival), and the shortest wait among the others.
local function best_of_tenant(c, t, now)
  local best, best_score, best_u, best_tokens, wait
  for _, u in ipairs(redis.call('SMEMBERS', S .. ':tu:' .. t)) do
    local head = redis.call('ZRANGE', S .. ':q:' .. t .. ':' .. u, 0, 0, 'WITHSCORES')
    if head[1] then
      local _, _, prompt, max = split(redis.call('HGET', S .. ':jobs', head[1]) or '||||')
      local tokens = prompt + (max or c.est)
      local w = blocked(c, u, tokens, now)
      if w == 0 then
        if best == nil or tonumber(head[2]) < best_score then
          best, best_score, best_u, best_tokens = head[1], tonumber(head[2]), u, tokens
        end
      elseif w > 0 and (wait == nil or w < wait) then
        wait = w
      end
    else
      redis.call('SREM', S .. ':tu:' .. t, u)
    end
  end
  return best, best_u, best_tokens, wait
end

-- Out of the waiting structures: job j of tenant t for upstream u.
local function forget(t, u, j)
  local q = S .. ':q:' .. t .. ':' .. u
  redis.call('ZREM', q, j)
  redis.call('HDEL', S .. ':jobs', j)
  redis.call('HINCRBY', S .. ':counts', 'waiting', -1)
  redis.call('HINCRBY', S .. ':counts', 't:' .. t, -1)
  redis.call('HINCRBY', S .. ':counts', 'u:' .. u, -1)
  if redis.call('ZCARD', q) == 0 then
    redis.call('SREM', S .. ':tu:' .. t, u)
    if redis.call('SCARD', S .. ':tu:' .. t) == 0 then redis.call('ZREM', S .. ':tenants', t) end
  end
end

-- Move the fairest job that may be sent now into the stream. Returns its entry id, or nil
-- and the shortest wait (ms) of a time-bound limit that holds the others back.
local function dispatch_one(c, now)
  local tenants = redis.call('ZRANGE', S .. ':tenants', 0, SCAN - 1, 'WITHSCORES')
  local wait
  for i = 1, #tenants, 2 do
    local t, pass = tenants[i], tonumber(tenants[i + 1])
    local j, u, tokens, w = best_of_tenant(c, t, now)
    if w ~= nil and (wait == nil or w < wait) then wait = w end
    if j ~= nil then
      forget(t, u, j)
      local after = pass + 1 / (c.weights[t] or 1)
      if redis.call('ZSCORE', S .. ':tenants', t) then
        redis.call('ZADD', S .. ':tenants', after, t)
      else
        redis.call('HSET', S .. ':last', t, after)
      end
      redis.call('HSET', S .. ':counts', 'vtime', pass)
      local fields = {'job', j, 'tenant', t, 'upstream', u}
      if c.limits[u] then
        fields[#fields + 1] = 'permit'
        fields[#fields + 1] = u
      end
      local entry = redis.call('XADD', K, '*', unpack(fields))
      take(c, u, tokens, entry, now)
      return entry, nil
    end
    if redis.call('SCARD', S .. ':tu:' .. t) == 0 then redis.call('ZREM', S .. ':tenants', t) end
  end
  return nil, wait
end

-- A tenant that starts waiting joins at the pass last chosen, or at its own pass when its
-- last job left later than that (it cannot gain a share by draining its queue each time).
local function join(t)
  local pass = tonumber(redis.call('HGET', S .. ':counts', 'vtime') or '0')
  local own = tonumber(redis.call('HGET', S .. ':last', t) or '0')
  if own > pass then pass = own end
  redis.call('HDEL', S .. ':last', t)
  if redis.call('HLEN', S .. ':last') > LAST_MAX then redis.call('DEL', S .. ':last') end
  redis.call('ZADD', S .. ':tenants', pass, t)
end

local function dispatch(c, n, now)
  local moved, wait = 0, nil
  while moved < n do
    local entry, w = dispatch_one(c, now)
    if entry == nil then
      wait = w
      break
    end
    moved = moved + 1
  end
  return moved, wait
end

-- After a job entered the queue or a permit came free: one fair job into the stream, so a
-- worker blocked reading it wakes, unless an entry is waiting there for a reader already.
local function wake(c, now)
  if redis.call('ZCARD', S .. ':tenants') > 0 and undelivered() == 0 then dispatch(c, 1, now) end
end
