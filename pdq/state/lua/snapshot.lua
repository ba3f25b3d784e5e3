-- ARGS: max_tenants max_heads now | tier names
-- ARGV: prefix, max tenants per tier, max requests per tenant, now, tier1, tier2, ...
-- A bounded, read-only view of the queue: per tier, the backlogged tenants with the lowest
-- counters, each with its weight ('' = default) and the head of its queue. Paused tiers and
-- tenants are left out; so are requests held back after a failure (retry_at in the future): the
-- answer ends with the earliest such retry_at (0 = none), when the dispatcher must look again.
-- -> {per tier {{tenant, counter, weight, {id, prompt_tokens, max_tokens, created_ms, deadline_ms,
-- avoid, ...}}, ...}, ..., next retry_at}
-- Replay: read-only.
local max_tenants, max_heads, now = tonumber(A.max_tenants), tonumber(A.max_heads), tonumber(A.now)
local paused = key('paused')
local next_retry = 0

local function heads_of(tier, tenant)
  local heads, got, from = {}, 0, 0
  local q = key('q', tier, tenant)
  while got < max_heads and from < 4 * max_heads do  -- past held-back requests, a bounded way
    local ids = redis.call('ZRANGE', q, from, from + max_heads - 1)
    for _, id in ipairs(ids) do
      local h = redis.call('HMGET', key('req', id), 'prompt_tokens', 'max_tokens', 'created_ms', 'deadline_ms',
                           'retry_at', 'avoid')
      local at = tonumber(h[5]) or 0
      if h[1] and at > now then
        if next_retry == 0 or at < next_retry then next_retry = at end
      elseif h[1] and got < max_heads then
        heads[#heads + 1] = id
        for j = 1, 4 do heads[#heads + 1] = h[j] end
        heads[#heads + 1] = h[6] or ''
        got = got + 1
      end
    end
    if #ids < max_heads then break end
    from = from + max_heads
  end
  return heads
end

local out = {}
for t = TAIL, #ARGV do
  local tier = ARGV[t]
  local tenants = {}
  if redis.call('SISMEMBER', paused, 'tier:' .. tier) == 0 then
    local rows = redis.call('ZRANGE', key('backlog', tier), 0, max_tenants + redis.call('SCARD', paused) - 1, 'WITHSCORES')
    for i = 1, #rows, 2 do
      local tenant = rows[i]
      if #tenants < max_tenants and redis.call('SISMEMBER', paused, 'tenant:' .. tenant) == 0 then
        local weight = redis.call('HGET', key('tenant', tenant), 'weight') or ''
        tenants[#tenants + 1] = {tenant, rows[i + 1], weight, heads_of(tier, tenant)}
      end
    end
  end
  out[#out + 1] = tenants
end
out[#out + 1] = next_retry
return out
