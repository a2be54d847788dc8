-- KEYS: queue, scheduler prefix. ARGV: 'pause' or 'resume', upstream. An operator's pause
-- of an upstream for the whole fleet: nothing more is dispatched to it (jobs already out of
-- the queue go on) until it is resumed; a resume wakes the queue, as a freed permit does.
-- Returns 1 when it changed something, else 0 (already paused, or not paused).
local u = ARGV[2]
if ARGV[1] == 'pause' then
  return redis.call('HSETNX', S .. ':paused', u, now_ms())
end
if redis.call('HDEL', S .. ':paused', u) == 0 then return 0 end
wake(load_config(), now_ms())
return 1
