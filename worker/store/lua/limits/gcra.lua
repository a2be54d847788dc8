-- GCRA (the generic cell rate algorithm): one number per key, the theoretical arrival time
-- of the next job. KEYS: the key's state. ARGV: now (ms), interval (ms), burst tolerance (ms).
-- Returns -1 when the job may go, else the milliseconds to wait.
local now = tonumber(ARGV[1])
local interval = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local wait = tat - tonumber(ARGV[3]) - now
if wait > 0 then return math.ceil(wait) end
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil(tat - now) + 1000)
return -1
