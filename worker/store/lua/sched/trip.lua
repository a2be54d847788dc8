-- KEYS: queue, scheduler prefix. ARGV: upstream, model ('' = the upstream itself could not
-- be reached), cooldown ms, longest cooldown ms, Retry-After ms ('' = none), why, the job.
-- A route's target failed: every worker skips it for a cooldown, then one job probes it. A
-- new failure, or its probe's, doubles the cooldown up to the longest (a Retry-After
-- replaces it, up to 60 s); a job sent before it went down failing too changes nothing but
-- a longer Retry-After. Returns the ms until it may be probed.
local u, m, j = ARGV[1], ARGV[2], ARGV[7]
local upstream_down, target_down = down_keys(u, m)
local key = m == '' and upstream_down or target_down
local now = now_ms()
local h = redis.call('HMGET', key, 'until', 'fails', 'probe')
local until_ms, fails = tonumber(h[1]), tonumber(h[2]) or 0
local retry_after = tonumber(ARGV[5])
if until_ms == nil or now >= until_ms or h[3] == j then
  fails = fails + 1
  local cooldown = math.min(tonumber(ARGV[3]) * 2 ^ (fails - 1), tonumber(ARGV[4]))
  if retry_after then cooldown = math.min(retry_after, MINUTE) end
  until_ms = now + cooldown
  if fails == 1 then redis.call('HSET', key, 'since', now) end
  redis.call('HSET', key, 'until', until_ms, 'fails', fails)
  redis.call('HDEL', key, 'probe', 'probe_at')
elseif retry_after and now + retry_after > until_ms then
  until_ms = now + math.min(retry_after, MINUTE)
  redis.call('HSET', key, 'until', until_ms)
end
redis.call('HSET', key, 'why', ARGV[6])
redis.call('PEXPIRE', key, until_ms - now + 10 * MINUTE)
if m ~= '' then redis.call('DEL', S .. ':ok:' .. target_key(u, m)) end
return until_ms - now
