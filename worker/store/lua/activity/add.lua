-- KEYS: one minute's activity hash. ARGV: ttl seconds, most fields, then field, increment
-- pairs. Adds a worker's counts of that minute. A tenant field (t:<name>:<what>) new to a
-- full hash counts as t:~other:<what> instead, so the hash never holds more than the most
-- fields plus the fixed ones. Returns the hash's field count.
local key, ttl, most = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local size = redis.call('HLEN', key)
for i = 3, #ARGV, 2 do
  local f, n = ARGV[i], tonumber(ARGV[i + 1])
  if string.sub(f, 1, 2) == 't:' and size >= most and redis.call('HEXISTS', key, f) == 0 then
    f = 't:~other' .. string.match(f, ':[^:]*$')
  end
  if redis.call('HINCRBY', key, f, n) == n then size = size + 1 end
end
redis.call('EXPIRE', key, ttl)
return size
