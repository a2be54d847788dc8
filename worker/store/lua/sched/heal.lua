-- KEYS: queue, scheduler prefix. ARGV: upstream, model, ms the answer counts as recent.
-- Target (u, m) answered (its first byte came): it and its upstream are up for every worker
-- (their cooldowns end, a running probe included), it needs no trial for a while, and the
-- jobs held back for it may go. Returns 1 when it had been down.
local u, m = ARGV[1], ARGV[2]
local was = redis.call('DEL', down_keys(u, m))
redis.call('SET', S .. ':ok:' .. target_key(u, m), '1', 'PX', ARGV[3])
local trial = redis.call('DEL', S .. ':trial:' .. target_key(u, m))
if was + trial > 0 then wake(load_config(), now_ms()) end
return was > 0 and 1 or 0
