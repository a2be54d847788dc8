-- KEYS: queue. ARGV: group, consumer, dead consumer, count. Claims up to count entries of a
-- consumer whose heartbeat stopped (their delivery counts go up: a takeover). Returns
-- {entries, 1 if the dead consumer holds nothing more}.
local rows = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[4]), ARGV[3])
if rows.err or #rows == 0 then return {{}, 1} end
local ids = {}
for i, row in ipairs(rows) do ids[i] = row[1] end
local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids))
local left = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[3])
return {claimed, #left == 0 and 1 or 0}
