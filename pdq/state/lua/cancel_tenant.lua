-- ARGS: tenant reason now ttl
-- ARGV: prefix, tenant, reason, now, ttl
-- Cancels every live request of a tenant, in any state. -> how many
-- Replay: the requests the first run ended left the tenant's live set: it cancels only what
-- was submitted since (a sweep's answer counts what that run did).
local n = 0
for _, id in ipairs(redis.call('SMEMBERS', key('live', A.tenant))) do
  local state = redis.call('HGET', key('req', id), 'state')
  if state and not TERMINAL[state] then
    finish(id, 'CANCELLED', 'cancelled', A.reason, A.now, A.ttl)
    n = n + 1
  else
    redis.call('SREM', key('live', A.tenant), id)
  end
end
return n
