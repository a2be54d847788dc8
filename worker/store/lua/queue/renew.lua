-- KEYS: queue, scheduler prefix. ARGV: group, consumer, then per entry: its id and the
-- upstream whose permit it holds ('' = none; one a worker moved it to counts instead).
-- Renews only the entries still ours, and their permits (a permit nobody renews for a lease
-- is free again: its worker is gone).
local lost = {}
local now
local any_moved = redis.call('EXISTS', S .. ':moved') == 1
for i = 3, #ARGV, 2 do
  local p = redis.pcall('XPENDING', K, ARGV[1], ARGV[i], ARGV[i], 1)
  if not p.err and p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', K, ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    local permit = ARGV[i + 1]
    local moved = any_moved and redis.call('HGET', S .. ':moved', ARGV[i])
    if moved then permit = string.match(moved, '([^|]*)$') end
    if permit ~= '' then
      now = now or now_ms()
      redis.call('ZADD', S .. ':permits:' .. permit, 'XX', now, ARGV[i])
    end
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
