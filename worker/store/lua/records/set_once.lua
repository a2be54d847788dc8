-- KEYS: record. ARGV: field, value. Sets the field unless it already has a value, and only
-- on an existing record (never creates one, so nothing outlives the record's TTL). Returns
-- the field's value afterwards, or false when there is no record.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HGET', KEYS[1], ARGV[1])
