-- ARGS: id lease
-- ARGV: prefix, scheduler id, lease (ms)
-- The dispatch lease ('leader': "{epoch} {id}", expiring `lease` ms after its last renewal):
-- held by this scheduler, it is renewed; free, this scheduler takes it under a new epoch
-- ('leader:epoch' + 1). -> {epoch, holder}: the epoch this scheduler leads under, or {0, the
-- holder's id} while another holds the lease.
-- Replay: the first run made this scheduler the holder; the replay renews it (same epoch).
local lk = key('leader')
local cur = redis.call('GET', lk)
if cur then
  local sp = string.find(cur, ' ', 1, true)
  local epoch, holder = string.sub(cur, 1, sp - 1), string.sub(cur, sp + 1)
  if holder ~= A.id then
    return {0, holder}
  end
  redis.call('PEXPIRE', lk, A.lease)
  return {tonumber(epoch), holder}
end
local epoch = redis.call('INCR', key('leader', 'epoch'))
redis.call('SET', lk, epoch .. ' ' .. A.id, 'PX', A.lease)
return {epoch, A.id}
