-- KEYS: queue, scheduler prefix. ARGV: consumer, count.
-- What a worker with `count` free slots reads: the entries waiting in the stream, then as
-- many of the fairest waiting jobs as the upstreams' limits let go now, all given to this
-- consumer. Returns {entries (XREADGROUP's reply, or false), wait}: wait is how many ms
-- until a time-bound limit (requests or tokens per minute, a 429's pause) may let a held-back
-- job go, -1 when none does (a permit that comes free dispatches by itself).
local consumer, count = ARGV[1], tonumber(ARGV[2])
local function read(n)
  local reply = redis.pcall('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', n, 'STREAMS', K, '>')
  if type(reply) == 'table' and reply.err then return nil, reply.err end
  if not reply or not reply[1] then return {} end
  return reply[1][2]
end
local rows, err = read(count)
if rows == nil then return {'nogroup', err} end
local wait = -1
if #rows < count and redis.call('EXISTS', S .. ':tenants') == 1 then
  local moved, w = dispatch(load_config(), count - #rows, now_ms())
  if w ~= nil then wait = w end
  if moved > 0 then
    for _, row in ipairs(read(moved)) do rows[#rows + 1] = row end
  end
end
return {rows, wait}
