-- KEYS: workers, workers' info (same slot). ARGV: name, timeout seconds, max dead, info
-- ('' = none). Sets this worker's heartbeat (and its info); returns {fresh (1: we were not
-- in the set), names of the workers whose heartbeat is older than the timeout}.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local fresh = redis.call('ZADD', KEYS[1], now, ARGV[1])
if ARGV[4] ~= nil and ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[4]) end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])),
  'LIMIT', 0, tonumber(ARGV[3]))
return {fresh, dead}
