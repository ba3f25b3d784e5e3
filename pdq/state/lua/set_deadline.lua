-- ARGV: prefix, id, deadline_ms (absolute)
-- Moves a live request's deadline (its order score is kept): the scheduler's janitor enforces it,
-- and workers running the request are told on the deadline channel.
-- -> the request's state; false when it does not exist
-- Replay: sets the same deadline again; workers hear the same deadline twice (they keep it).
local rk = key('req', ARGV[2])
local state = redis.call('HGET', rk, 'state')
if not state then return false end
if TERMINAL[state] then return state end
redis.call('HSET', rk, 'deadline_ms', ARGV[3])
redis.call('ZADD', key('deadlines'), ARGV[3], ARGV[2])
redis.call('PUBLISH', key('deadline'), ARGV[2] .. ' ' .. ARGV[3])
return state
