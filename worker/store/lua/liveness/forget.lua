-- KEYS: workers, workers' info (same slot). ARGV: name, timeout seconds. Forgets a dead
-- worker (and what it reported), unless it beat since.
local t = redis.call('TIME')
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) < tonumber(t[1]) - tonumber(ARGV[2]) then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
