-- KEYS: queue, scheduler prefix. ARGV: upstream, ms. The upstream answered 429: nothing
-- more is sent to it for `ms` (a pause already longer is kept).
local key = S .. ':cool:' .. ARGV[1]
if redis.call('PTTL', key) < tonumber(ARGV[2]) then
  redis.call('SET', key, '1', 'PX', ARGV[2])
end
return 1
