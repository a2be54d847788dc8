-- KEYS: queue. ARGV: group, consumer, entry id, lease ms. Before a start: the entry is still
-- ours and its delivery (or our last renewal) is younger than the lease. Renews it and
-- returns its delivery count (the start's fencing token); 0 when it may not start.
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p.err or not (p[1] and p[1][2] == ARGV[2]) then return 0 end
if p[1][3] >= tonumber(ARGV[4]) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return p[1][4]
