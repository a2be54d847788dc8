-- KEYS: queue, scheduler prefix. ARGV: job id, entry id, route, tokens, the upstream whose
-- permit the entry holds as the worker knows it ('' = none), '1' for the route's context
-- fallback (the prompt was too long for its targets).
-- A started job of a route needs a target (its first was down, failed, or it was taken over):
-- the next one that is up and has room, as the dispatch would choose. The entry's permit
-- moves to the target's upstream (`moved` remembers it for the ack, the renewals and a
-- requeue), with the minute's request and tokens. Returns {'target', index (from 0), 1 if it
-- is the target's probe}, {'wait', ms} (-1: until a permit comes free) or {'noroute'}.
local c = load_config()
local j, entry, r, tokens = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]) or 0
if c.routes[r] == nil then return {'noroute'} end
local first = 1  -- the index (from 1) of the route's first target here
if ARGV[6] == '1' then  -- its context fallback, alone, after its targets
  if not c.routes[r].c then return {'noroute'} end
  first = #c.routes[r].t + 1
  c.routes[r] = {s = 'fallback', t = {c.routes[r].c}}
end
local now = now_ms()
local i, state = choose(c, r, tokens, now)
write_weights()
if i == nil then return {'wait', state or -1} end
local u = c.routes[r].t[i][1]
local held = ARGV[5]
local moved = redis.call('HGET', S .. ':moved', entry)
if moved then held = string.match(moved, '([^|]*)$') end
if held == u then
  take_request(c, u, now)
else
  if held ~= '' then release(held, entry) end
  take(c, u, tokens, entry, now)
end
local permit = c.limits[u] and u or ''
redis.call('HSET', S .. ':moved', entry, u .. '|' .. (first + i - 2) .. '|' .. permit)
sent(c, r, i, state, j, now)
return {'target', first + i - 2, state == 'probe' and 1 or 0}
