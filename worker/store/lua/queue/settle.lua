-- KEYS: queue, scheduler prefix. ARGV: group, consumer, entry id, job id ('' = ack only).
-- Acks (and deletes) the entry if this consumer still owns it; with a job id, a fresh entry
-- for the job (the same fields: its tenant, upstream and permit go with it, or the target
-- and permit a worker moved it to) replaces it.
-- An ack frees the entry's permit and lets the fairest waiting job into the stream (sched
-- lib's wake). Returns the new entry id, 1 (acked), or 0 (not ours: no-op).
local p = redis.pcall('XPENDING', K, ARGV[1], ARGV[3], ARGV[3], 1)
if p.err or not (p[1] and p[1][2] == ARGV[2]) then return 0 end
local row = redis.call('XRANGE', K, ARGV[3], ARGV[3])
local fields = row[1] and row[1][2] or {}
local moved = redis.call('HGET', S .. ':moved', ARGV[3])
if moved then
  fields = moved_fields(fields, moved)
  redis.call('HDEL', S .. ':moved', ARGV[3])
end
local permit
for i = 1, #fields, 2 do
  if fields[i] == 'permit' then permit = fields[i + 1] end
end
local fresh = 1
if ARGV[4] ~= '' then
  if #fields == 0 then fields = {'job', ARGV[4]} end
  fresh = redis.call('XADD', K, '*', unpack(fields))
end
redis.call('XACK', K, ARGV[1], ARGV[3])
redis.call('XDEL', K, ARGV[3])
if permit then
  redis.call('ZREM', S .. ':permits:' .. permit, ARGV[3])
  if ARGV[4] ~= '' then redis.call('ZADD', S .. ':permits:' .. permit, now_ms(), fresh) end
end
if ARGV[4] == '' then wake(load_config(), now_ms()) end
return fresh
