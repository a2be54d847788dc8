-- KEYS: record. ARGV: now. On a terminal record, a write that replicates (the WAIT after it
-- then counts the replicas that have the terminal state); its status, or 'missing'.
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'succeeded' or status == 'failed' or status == 'cancelled' then
  redis.call('HSET', KEYS[1], 'replica_check', ARGV[1])
end
return status or 'missing'
