-- ARGS: now max_attempts ttl limit max_lost fence
-- ARGV: prefix, now, max_attempts, ttl, limit, max_lost, leader epoch (lib.lua `deposed`)
-- Gives back requests whose prefill lease expired (claimed, never handed off: e.g. the scheduler
-- died before sending the batch, or a worker dropped it): lost attempts. -> {requeued, failed},
-- or 'FENCED' (nothing done) when the leader epoch is not the latest
-- Replay: the first run took them off the lease set: nothing left to do, {0, 0}.
if deposed(A.fence) then
  return FENCED
end
local requeued, failed = 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', key('leases'), '-inf', A.now, 'LIMIT', 0, A.limit)) do
  local s = redis.call('HGET', key('req', id), 'state')
  if s == 'PREFILLING' or s == 'TRANSFERRING' then
    if requeue(id, 'prefill lease expired', A.now, 'lost', {A.max_attempts, A.max_lost, 0, 0}, A.ttl) == 'QUEUED' then
      requeued = requeued + 1
    else
      failed = failed + 1
    end
  else
    redis.call('ZREM', key('leases'), id)
  end
end
return {requeued, failed}
