-- KEYS: queue, scheduler prefix. ARGV: upstream. Before a retry of a job already out of
-- the queue: one more request of the minute's budget. Returns 0 (taken), or the ms to wait
-- before asking again (the minute's requests are spent, or the upstream answered 429).
local c, u = load_config(), ARGV[1]
local lim = c.limits[u]
if not lim then return 0 end
local now = now_ms()
local cool = redis.call('PTTL', S .. ':cool:' .. u)
if cool > 0 then return cool end
if lim.rpm then
  local key = S .. ':rpm:' .. u
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - MINUTE)
  if redis.call('ZCARD', key) >= lim.rpm then
    local oldest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    return math.max(1, tonumber(oldest[2]) + MINUTE - now)
  end
end
take_request(c, u, now)
return 0
