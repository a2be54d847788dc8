-- The fair choice of the next job, and its move into the stream (prepended to every
-- scheduler script after sched/lib.lua and sched/routes.lua).

-- Whether a job of `tokens` tokens waiting for `name` (an upstream, or a route) may go now:
-- 0 and where it goes ({u = upstream} or {u, r = route, i = target, state}), else the ms to
-- wait (-1: until a permit comes free).
local function admit(c, name, tokens, now)
  if c.routes[name] == nil then
    local w = blocked(c, name, tokens, now)
    if w ~= 0 then return w end
    return 0, {u = name}
  end
  if c.paused[name] then return -1 end  -- an operator paused the route
  local i, state = choose(c, name, tokens, now)
  if i == nil then return state or -1 end
  return 0, {u = c.routes[name].t[i][1], r = name, i = i, state = state}
end

-- The head of tenant t's queue for each upstream (or route) it waits on: the best one that
-- may be sent now (lowest score: priority, then arrival), and the shortest wait among the
-- others.
local function best_of_tenant(c, t, now)
  local best, best_score, best_name, best_tokens, best_to, wait
  for _, name in ipairs(redis.call('SMEMBERS', S .. ':tu:' .. t)) do
    local head = redis.call('ZRANGE', S .. ':q:' .. t .. ':' .. name, 0, 0, 'WITHSCORES')
    if head[1] then
      local _, _, prompt, max = split(redis.call('HGET', S .. ':jobs', head[1]) or '||||')
      local tokens = prompt + (max or c.est)
      local w, to = admit(c, name, tokens, now)
      if w == 0 then
        if best == nil or tonumber(head[2]) < best_score then
          best, best_score, best_name, best_tokens, best_to = head[1], tonumber(head[2]), name,
            tokens, to
        end
      elseif w > 0 and (wait == nil or w < wait) then
        wait = w
      end
    else
      redis.call('SREM', S .. ':tu:' .. t, name)
    end
  end
  return best, best_name, best_tokens, best_to, wait
end

-- The stream entry's fields for job j of tenant t going to `to` (see admit).
local function entry_fields(c, j, t, to)
  local fields = {'job', j, 'tenant', t, 'upstream', to.u}
  if to.r then
    fields[#fields + 1] = 'route'
    fields[#fields + 1] = to.r
    fields[#fields + 1] = 'target'
    fields[#fields + 1] = tostring(to.i - 1)
    if to.state == 'probe' then
      fields[#fields + 1] = 'probe'
      fields[#fields + 1] = '1'
    end
  end
  if c.limits[to.u] then
    fields[#fields + 1] = 'permit'
    fields[#fields + 1] = to.u
  end
  return fields
end

-- One waiting job less in the counts field f; a count back to 0 is deleted (a tenant that
-- left keeps no field).
local function count_down(f)
  if redis.call('HINCRBY', S .. ':counts', f, -1) <= 0 then redis.call('HDEL', S .. ':counts', f) end
end

-- Out of the waiting structures: job j of tenant t for upstream u.
local function forget(t, u, j)
  local q = S .. ':q:' .. t .. ':' .. u
  redis.call('ZREM', q, j)
  redis.call('HDEL', S .. ':jobs', j)
  redis.call('HINCRBY', S .. ':counts', 'waiting', -1)
  count_down('t:' .. t)
  count_down('u:' .. u)
  if redis.call('ZCARD', q) == 0 then
    redis.call('SREM', S .. ':tu:' .. t, u)
    if redis.call('SCARD', S .. ':tu:' .. t) == 0 then redis.call('ZREM', S .. ':tenants', t) end
  end
end

-- Tenant t's last waiting job left at `pass`: it rejoins at `after` at the earliest. Only
-- passes still ahead of vtime matter; of those the LEFT_MAX highest are kept (a tenant
-- forgotten rejoins at vtime, at most one turn early).
local function remember_left(t, after, vtime)
  local key = S .. ':left'
  redis.call('ZADD', key, after, t)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', vtime)
  local extra = redis.call('ZCARD', key) - LEFT_MAX
  if extra > 0 then redis.call('ZREMRANGEBYRANK', key, 0, extra - 1) end
end

-- Move the fairest job that may be sent now into the stream. Returns its entry id, or nil
-- and the shortest wait (ms) of a time-bound limit that holds the others back.
local function dispatch_one(c, now)
  local tenants = redis.call('ZRANGE', S .. ':tenants', 0, SCAN - 1, 'WITHSCORES')
  local wait
  for i = 1, #tenants, 2 do
    local t, pass = tenants[i], tonumber(tenants[i + 1])
    local j, name, tokens, to, w = best_of_tenant(c, t, now)
    if w ~= nil and (wait == nil or w < wait) then wait = w end
    if j ~= nil then
      forget(t, name, j)
      local after = pass + 1 / (c.weights[t] or 1)
      redis.call('HSET', S .. ':counts', 'vtime', pass)
      if redis.call('ZSCORE', S .. ':tenants', t) then
        redis.call('ZADD', S .. ':tenants', after, t)
      else
        remember_left(t, after, pass)
      end
      local entry = redis.call('XADD', K, '*', unpack(entry_fields(c, j, t, to)))
      take(c, to.u, tokens, entry, now)
      if to.r then sent(c, to.r, to.i, to.state, j, now) end
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
  local own = redis.call('ZSCORE', S .. ':left', t)
  if own then
    pass = math.max(pass, tonumber(own))
    redis.call('ZREM', S .. ':left', t)
  end
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
  write_weights()
  return moved, wait
end

-- After a job entered the queue or a permit came free: one fair job into the stream, so a
-- worker blocked reading it wakes, unless an entry is waiting there for a reader already.
local function wake(c, now)
  if redis.call('ZCARD', S .. ':tenants') > 0 and undelivered() == 0 then dispatch(c, 1, now) end
end
