-- KEYS: queue, scheduler prefix. ARGV: group, consumer, then per entry: its id and the
-- upstream whose permit it holds ('' = none). Renews only the entries still ours, and their
-- permits (a permit nobody renews for a lease is free again: its worker is gone).
local lost = {}
local now
for i = 3, #ARGV, 2 do
  local p = redis.pcall('XPENDING', K, ARGV[1], ARGV[i], ARGV[i], 1)
  if not p.err and p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', K, ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    if ARGV[i + 1] ~= '' then
      now = now or now_ms()
      redis.call('ZADD', S .. ':permits:' .. ARGV[i + 1], 'XX', now, ARGV[i])
    end
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
