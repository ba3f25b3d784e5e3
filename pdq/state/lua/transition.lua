-- ARGS: id epoch state | field, value pairs
-- ARGV: prefix, id, epoch, state, field1, value1, ...
-- Moving to DECODING ends the prefill lease (the decode worker's heartbeat covers it from then).
-- -> {1, deadline_ms} when moved (the record's deadline: an operator may have moved it since the
-- spec the worker holds was written, and a worker can miss that notice), 0 when the epoch is stale
-- or the request ended
-- Replay: writes the same state and fields again under the same epoch and answers 1 (the worker
-- that sent it waits for the reply, so nothing of this attempt moved it on meanwhile); if the
-- request ended or was requeued in between, it answers 0 as any late call would.
local rk = key('req', A.id)
local h = redis.call('HMGET', rk, 'state', 'epoch')
if not h[1] or TERMINAL[h[1]] or h[2] ~= A.epoch then return 0 end
redis.call('HSET', rk, 'state', A.state)
for i = TAIL, #ARGV, 2 do redis.call('HSET', rk, ARGV[i], ARGV[i + 1]) end
if A.state == 'DECODING' then redis.call('ZREM', key('leases'), A.id) end
return {1, redis.call('HGET', rk, 'deadline_ms') or '0'}
