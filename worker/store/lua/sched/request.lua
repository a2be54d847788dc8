-- KEYS: queue, scheduler prefix. ARGV: upstream. Before a retry of a job already out of
-- the queue: one more request of the minute's budget. Returns 0 (taken), or the ms to wait
-- before asking again (the minute's requests are spent, or the upstream answered 429).
local c, u = load_config(), ARGV[1]
local lim = c.limits[u]
if not lim then return 0 end
local now = now_ms()
local cool = redis.call('PTTL', S .. ':cool:' .. u)
if cool > 0 then return cool end
local wait = rpm_wait(c, lim, u, now)
if wait > 0 then return wait end
take_request(c, u, now)
return 0
