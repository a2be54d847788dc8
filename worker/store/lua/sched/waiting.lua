-- KEYS: queue, scheduler prefix. ARGV: start, count. Reads only (the dashboard's): for
-- `count` tenants with waiting jobs from the `start`-th in pass order, its waiting jobs by
-- priority and when the oldest of them was enqueued (ms; 0: unknown). Returns a flat list
-- {tenant, high, normal, low, oldest ms, ...}. Costs about nine calls per tenant and
-- upstream, so a caller bounds each call's time with `count`.
local S = KEYS[2]
local RANK = 1e13
local out = {}
local first = tonumber(ARGV[1])
for _, t in ipairs(redis.call('ZRANGE', S .. ':tenants', first, first + tonumber(ARGV[2]) - 1)) do
  local counts, oldest = {0, 0, 0}, nil
  for _, u in ipairs(redis.call('SMEMBERS', S .. ':tu:' .. t)) do
    local q = S .. ':q:' .. t .. ':' .. u
    for r = 0, 2 do
      local low, high = r * RANK, '(' .. ((r + 1) * RANK)
      local head = redis.call('ZRANGEBYSCORE', q, low, high, 'LIMIT', 0, 1)
      if head[1] then
        counts[r + 1] = counts[r + 1] + redis.call('ZCOUNT', q, low, high)
        local info = redis.call('HGET', S .. ':jobs', head[1])
        local when = info and tonumber(string.match(info, '|(%d+)$'))
        if when and (oldest == nil or when < oldest) then oldest = when end
      end
    end
  end
  out[#out + 1] = t
  out[#out + 1] = counts[1]
  out[#out + 1] = counts[2]
  out[#out + 1] = counts[3]
  out[#out + 1] = oldest or 0
end
return out
