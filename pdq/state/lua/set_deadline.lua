-- ARGS: id deadline
-- ARGV: prefix, id, deadline_ms (absolute)
-- Moves a live request's deadline (its order score is kept): the scheduler's janitor enforces it,
-- and workers running the request are told on the deadline channel.
-- -> the request's state; false when it does not exist
-- Replay: sets the same deadline again; workers hear the same deadline twice (they keep it).
local rk = key('req', A.id)
local state = redis.call('HGET', rk, 'state')
if not state then return false end
if TERMINAL[state] then return state end
redis.call('HSET', rk, 'deadline_ms', A.deadline)
redis.call('ZADD', key('deadlines'), A.deadline, A.id)
redis.call('PUBLISH', key('deadline'), A.id .. ' ' .. A.deadline)
return state
