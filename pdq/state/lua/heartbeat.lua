-- ARGS: worker role ttl now | field, value pairs
-- ARGV: prefix, worker id, role, ttl (ms), now, field1, value1, ...
-- Registers or refreshes a worker: its facts, their expiry and its heartbeat time. It tells the
-- scheduler on the heartbeat channel only while requests are queued: a freed slot is news only
-- to queued work (with none, every such message woke the scheduler for nothing).
-- Replay: the same facts and time again; one more wake-up message at most.
local wk, now = key('worker', A.worker), A.now
redis.call('HSET', wk, 'heartbeat_ms', now, unpack(ARGV, TAIL))
redis.call('PEXPIRE', wk, A.ttl)
redis.call('ZADD', key('workers', A.role), now, A.worker)
if num(redis.call('HGET', key('load'), 'n'), 0) > 0 then
  redis.call('PUBLISH', key('heartbeats'), A.worker)
end
