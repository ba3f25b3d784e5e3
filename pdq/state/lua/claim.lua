-- ARGS: now worker address lease_until weight token fence | per request: id, decode worker id
-- ARGV: prefix, now, prefill worker id, prefill address, lease expiry (ms), default weight, token
-- (this call's: the batch id), leader epoch (lib.lua `deposed`), then per request: id, decode
-- worker id
-- Moves each still-QUEUED request to PREFILLING under a new epoch, leased to both workers, and
-- charges its tenant. -> per request {epoch, spec}, {0, ''} where it was no longer queued;
-- 'FENCED' (nothing claimed) when the leader epoch is not the latest
-- Replay: a request this call already claimed is PREFILLING with this call's token on its record
-- ('claim'): the replay answers its epoch and spec again and changes nothing (its reply was lost,
-- so no worker has it yet). Without the token a replayed claim would see the requests no longer
-- queued, and the dispatcher would drop them until their lease expired.
if deposed(A.fence) then
  return FENCED
end
local out = {}
for i = TAIL, #ARGV, 2 do
  local id, decode = ARGV[i], ARGV[i + 1]
  local rk = key('req', id)
  local h = redis.call('HMGET', rk, 'state', 'tier', 'tenant', 'cost', 'claim', 'epoch')
  if h[1] == 'QUEUED' then
    local ep = redis.call('HINCRBY', rk, 'epoch', 1)
    redis.call('HINCRBY', rk, 'attempts', 1)
    redis.call('HSETNX', rk, 'dispatched_ms', A.now)
    redis.call('HSET', rk, 'state', 'PREFILLING', 'prefill_worker', A.address,
      'lease_prefill', A.worker, 'lease_decode', decode, 'claim', A.token)
    charge(rk, h[2], h[3], h[4], tonumber(A.weight))
    unqueue(id, h[2], h[3], h[4])
    redis.call('SADD', key('held', A.worker), id)
    redis.call('SADD', key('held', decode), id)
    redis.call('HINCRBY', key('load'), 'running', 1)
    redis.call('HINCRBY', key('load'), 'running:' .. h[3], 1)
    redis.call('ZADD', key('leases'), A.lease_until, id)
    out[#out + 1] = {ep, redis.call('HGET', rk, 'spec')}
  elseif h[1] == 'PREFILLING' and h[5] == A.token then
    out[#out + 1] = {tonumber(h[6]), redis.call('HGET', rk, 'spec')}
  else
    out[#out + 1] = {0, ''}
  end
end
return out
