-- ARGS: worker now max_attempts ttl max_lost fence
-- ARGV: prefix, worker id, now, max_attempts, ttl, max_lost, leader epoch (lib.lua `deposed`)
-- A worker stopped heartbeating: every current attempt it takes part in is lost (requeue kind
-- 'lost'; a prefill worker's only while the request is still in its hands). -> {requeued, failed},
-- or 'FENCED' (nothing done) when the leader epoch is not the latest
-- Replay: the first run emptied the worker's held set: nothing left to do, {0, 0}.
if deposed(A.fence) then
  return FENCED
end
local w = A.worker
local held = key('held', w)
local requeued, failed = 0, 0
for _, id in ipairs(redis.call('SMEMBERS', held)) do
  local h = redis.call('HMGET', key('req', id), 'state', 'lease_prefill', 'lease_decode')
  local s = h[1]
  if s and not TERMINAL[s] and s ~= 'QUEUED'
      and (h[3] == w or (h[2] == w and (s == 'PREFILLING' or s == 'TRANSFERRING'))) then
    if requeue(id, 'worker ' .. w .. ' stopped heartbeating', A.now, 'lost',
               {A.max_attempts, A.max_lost, 0, 0}, A.ttl) == 'QUEUED' then
      requeued = requeued + 1
    else
      failed = failed + 1
    end
  end
end
redis.call('DEL', held)
return {requeued, failed}
