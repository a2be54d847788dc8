-- KEYS: queue. ARGV: group, consumer, entry id, job id ('' = ack only).
-- Acks (and deletes) the entry if this consumer still owns it; with a job id, a fresh entry
-- for the job replaces it. Returns the new entry id, 1 (acked), or 0 (not ours: no-op).
local p = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p.err or not (p[1] and p[1][2] == ARGV[2]) then return 0 end
local fresh = 1
if ARGV[4] ~= '' then fresh = redis.call('XADD', KEYS[1], '*', 'job', ARGV[4]) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return fresh
