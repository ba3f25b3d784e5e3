-- ARGS: now limit ttl fence
-- ARGV: prefix, now, limit, ttl, leader epoch (lib.lua `deposed`)
-- Ends live requests whose deadline has passed, in any state. -> how many it looked at, or
-- 'FENCED' (nothing done) when the leader epoch is not the latest
-- Replay: the requests the first run ended left the deadline set: it finds only what came due
-- since (a sweep's answer counts what that run did).
if deposed(A.fence) then
  return FENCED
end
local due = redis.call('ZRANGEBYSCORE', key('deadlines'), '-inf', A.now, 'LIMIT', 0, A.limit)
for _, id in ipairs(due) do
  local state = redis.call('HGET', key('req', id), 'state')
  if state and not TERMINAL[state] then
    finish(id, 'TIMED_OUT', 'timeout', 'deadline exceeded', A.now, A.ttl)
  else
    redis.call('ZREM', key('deadlines'), id)
  end
end
return #due
