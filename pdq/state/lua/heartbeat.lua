-- ARGV: prefix, worker id, role, ttl (ms), now, field1, value1, ...
-- Registers or refreshes a worker: its facts, their expiry and its heartbeat time. It tells the
-- scheduler on the heartbeat channel only while requests are queued: a freed slot is news only
-- to queued work (with none, every such message woke the scheduler for nothing).
-- Replay: the same facts and time again; one more wake-up message at most.
local wk, now = key('worker', ARGV[2]), ARGV[5]
redis.call('HSET', wk, 'heartbeat_ms', now, unpack(ARGV, 6))
redis.call('PEXPIRE', wk, ARGV[4])
redis.call('ZADD', key('workers', ARGV[3]), now, ARGV[2])
if num(redis.call('HGET', key('load'), 'n'), 0) > 0 then
  redis.call('PUBLISH', key('heartbeats'), ARGV[2])
end
