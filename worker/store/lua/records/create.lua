-- KEYS: record, events. ARGV: field/value pairs of the new record, retention.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HGET', KEYS[1], 'queue_entry') and 'exists' or 'unqueued'
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 'created'
