-- KEYS: queue, scheduler prefix. ARGV: job id. Takes a waiting job out of its tenant's
-- queue (it was cancelled). Returns 1, or 0 when it was not waiting (already dispatched).
local info = redis.call('HGET', S .. ':jobs', ARGV[1])
if not info then return 0 end
local t, u = split(info)
forget(t, u, ARGV[1])
return 1
