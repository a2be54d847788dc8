-- KEYS: queue. ARGV: group, consumer. Removes the consumer if it holds no entries.
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if p.err or p[1] then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
