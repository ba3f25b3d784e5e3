-- ARGS: tenant state tier limit cursor scan
-- ARGV: prefix, tenant ('' = all), state ('' = any), tier ('' = any), limit,
-- cursor (list below this arrival seq; '' = from the newest), most index entries to look at
-- Requests newest first, filtered. Looks at a bounded number of entries, so a page may be short;
-- the cursor goes on from the last entry looked at. Entries whose record expired are dropped.
-- -> {ids, next cursor ('' = no more)}
-- Replay: its only writes drop index entries of expired records, which stay dropped.
local idx = key('index')
if A.tenant ~= '' then idx = key('index', A.tenant) end
local limit, budget = tonumber(A.limit), tonumber(A.scan)
local top = '+inf'
if A.cursor ~= '' then top = '(' .. A.cursor end
local out, last = {}, nil
while #out < limit and budget > 0 do
  local rows = redis.call('ZREVRANGEBYSCORE', idx, top, '-inf', 'WITHSCORES', 'LIMIT', 0, math.min(budget, 256))
  if #rows == 0 then return {out, ''} end
  for i = 1, #rows, 2 do
    local id = rows[i]
    last = rows[i + 1]
    budget = budget - 1
    local h = redis.call('HMGET', key('req', id), 'state', 'tier')
    if not h[1] then
      redis.call('ZREM', idx, id)
    elseif (A.state == '' or h[1] == A.state) and (A.tier == '' or h[2] == A.tier) then
      out[#out + 1] = id
      if #out == limit then break end
    end
  end
  top = '(' .. last
end
if #redis.call('ZREVRANGEBYSCORE', idx, top, '-inf', 'LIMIT', 0, 1) == 0 then return {out, ''} end
return {out, last}
