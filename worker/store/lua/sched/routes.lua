-- Routes: a model name served by several targets (upstream, model), the targets' health kept
-- for the whole fleet, and the choice of a target for a job (docs/routing.md; decision 71).
--
-- config r:<route> = JSON {"s": "fallback" | "weighted", "t": [[upstream, model, weight],
-- ...]}, written by the workers. Keys under S (TTLs, except wrr and moved):
--   down:<u>        hash: upstream u could not be reached (refused, reset, TLS, DNS): every
--                   target on it is skipped
--   down:<u>|<m>    hash: target (u, m) answered a retryable status or error chunk; both:
--                   until (ms), since (ms), fails (in a row), why, probe (the job trying it
--                   once its cooldown is over) and probe_at (ms)
--   ok:<u>|<m>      string: the target answered lately (workers refresh it)
--   trial:<u>|<m>   counter: jobs sent to a target no answer has confirmed lately
--   wrr:<route>     hash: target index -> current weight (smooth weighted round-robin)
--   moved           hash: entry id -> 'upstream|target|permit' it was moved to by a worker
--                   (a stream entry's own fields cannot change); gone with its ack
local TRIAL = 4  -- jobs at once to a target that no answer confirmed lately
local TRIAL_MS = 10000  -- how long those count
local POLL_MS = 100  -- the wait for a probe's or a trial's answer

local function target_key(u, m)
  return u .. '|' .. m
end

-- The breakers target (u, m) passes: its upstream's (it could not be reached), its own.
local function down_keys(u, m)
  return S .. ':down:' .. u, S .. ':down:' .. target_key(u, m)
end

-- The shorter of two waits (ms): a positive wait beats -1 (a permit's), which beats none.
local function shorter(a, b)
  if a == nil or a == 0 then return b end
  if b == nil or b == 0 then return a end
  if a < 0 then return b end
  if b < 0 then return a end
  return math.min(a, b)
end

-- 'up', 'probe' (its cooldown is over and no probe runs: the next job may try it), or
-- 'down' with the ms until that may change.
local function down_state(key, now, lease)
  local h = redis.call('HMGET', key, 'until', 'probe_at')
  local until_ms = tonumber(h[1])
  if not until_ms then return 'up', 0 end
  if now < until_ms then return 'down', until_ms - now end
  local probe_at = tonumber(h[2])
  if probe_at and now - probe_at < lease then return 'down', POLL_MS end
  return 'probe', 0
end

-- Target (u, m): 'up' (it answered lately), 'new' (no answer confirmed it lately: a job
-- may go as one of its trial), 'trial' (TRIAL jobs are on their way to it already: wait
-- for their answers), 'probe', or 'down' (its upstream or itself), with the ms to wait.
local known = {}  -- within one script call: target -> {state, wait} (a pick asks for many jobs)

local function health_now(c, u, m, now)
  local tk = target_key(u, m)
  local upstream_down, target_down = down_keys(u, m)
  if redis.call('EXISTS', upstream_down, target_down) > 0 then
    local su, wu = down_state(upstream_down, now, c.lease_ms)
    if su == 'down' then return 'down', wu end
    local st, wt = down_state(target_down, now, c.lease_ms)
    if st == 'down' then return 'down', wt end
    return 'probe', 0
  end
  if redis.call('EXISTS', S .. ':ok:' .. tk) == 1 then return 'up', 0 end
  if tonumber(redis.call('GET', S .. ':trial:' .. tk) or '0') >= TRIAL then
    return 'trial', POLL_MS
  end
  return 'new', 0
end

local function health(c, u, m, now)
  local tk = target_key(u, m)
  local seen = known[tk]
  if seen == nil then
    seen = {health_now(c, u, m, now)}
    known[tk] = seen
  end
  return seen[1], seen[2]
end

local weights = {}  -- within one script call: route -> its round-robin state, read once
local weights_changed = {}  -- routes whose state changed in this call (write_weights)

-- Smooth weighted round-robin among the eligible targets {index, weight, state}: exact
-- shares over every sum of the weights' picks, and no run of one target. A choice that
-- falls on a target still on trial waits for its answers (nothing is written), so that a
-- target answering first does not take a whole burst.
local function smooth_weighted(r, eligible)
  local current = weights[r]
  if current == nil then
    current = {}
    local flat = redis.call('HGETALL', S .. ':wrr:' .. r)
    for i = 1, #flat, 2 do current[tonumber(flat[i])] = tonumber(flat[i + 1]) end
    weights[r] = current
  end
  local total, best = 0, nil
  local next_weight = {}
  for _, e in ipairs(eligible) do
    next_weight[e[1]] = (current[e[1]] or 0) + e[2]
    total = total + e[2]
    if best == nil or next_weight[e[1]] > next_weight[best[1]] then best = e end
  end
  if best[3] == 'trial' then return nil, POLL_MS end
  next_weight[best[1]] = next_weight[best[1]] - total
  for index, weight in pairs(next_weight) do current[index] = weight end
  weights_changed[r] = true
  return best[1], best[3]
end

-- The round-robin states this call changed, written once (after a dispatch of many jobs).
local function write_weights()
  for r in pairs(weights_changed) do
    local flat = {}
    for index, weight in pairs(weights[r]) do
      flat[#flat + 1] = index
      flat[#flat + 1] = string.format('%.17g', weight)
    end
    redis.call('HSET', S .. ':wrr:' .. r, unpack(flat))
  end
  weights_changed = {}
end

-- A target of route r for a job of `tokens` tokens: `fallback` takes the first in order that
-- is up and has room, `weighted` chooses by weight among those; a target at its limits is
-- passed over (spill-over), and a down one. Returns the target's index and health ('up',
-- 'new' or 'probe'), or nil and the ms until one may have room (-1: when a permit comes
-- free). A choice that falls on a target awaiting its first answers ('trial') waits.
local function choose(c, r, tokens, now)
  local route = c.routes[r]
  local eligible, wait = {}, nil
  for i, t in ipairs(route.t) do
    local state, w = health(c, t[1], t[2], now)
    if state ~= 'down' then
      w = blocked(c, t[1], tokens, now)
      if w == 0 then
        if route.s ~= 'weighted' then
          if state == 'trial' then return nil, POLL_MS end
          return i, state
        end
        eligible[#eligible + 1] = {i, tonumber(t[3]) or 1, state}
      end
    end
    wait = shorter(wait, w)
  end
  if #eligible == 0 then return nil, wait end
  return smooth_weighted(r, eligible)
end

-- Job j goes to target i of route r: a probe is marked as the one trying it; a job to a
-- target no answer confirmed lately counts as one of its trial.
local function sent(c, r, i, state, j, now)
  local t = c.routes[r].t[i]
  local tk = target_key(t[1], t[2])
  if state == 'probe' then
    for _, key in ipairs({down_keys(t[1], t[2])}) do
      if redis.call('EXISTS', key) == 1 then
        redis.call('HSET', key, 'probe', j, 'probe_at', now)
      end
    end
    known[tk] = nil  -- its probe is taken: asked again
  elseif state == 'new' then
    redis.call('INCR', S .. ':trial:' .. tk)
    redis.call('PEXPIRE', S .. ':trial:' .. tk, TRIAL_MS)
    known[tk] = nil  -- one more on trial: asked again
  end
end

-- A stream entry's fields with the target a worker moved it to ('upstream|target|permit').
local function moved_fields(fields, moved)
  local u, i, permit = string.match(moved, '^([^|]*)|([^|]*)|([^|]*)$')
  local out = {}
  for n = 1, #fields, 2 do
    local f = fields[n]
    if f ~= 'upstream' and f ~= 'target' and f ~= 'permit' and f ~= 'probe' then
      out[#out + 1] = f
      out[#out + 1] = fields[n + 1]
    end
  end
  out[#out + 1] = 'upstream'
  out[#out + 1] = u
  out[#out + 1] = 'target'
  out[#out + 1] = i
  if permit ~= '' then
    out[#out + 1] = 'permit'
    out[#out + 1] = permit
  end
  return out
end
