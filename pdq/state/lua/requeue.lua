-- ARGV: prefix, id, epoch, now, max_attempts, error, ttl, kind ('failure' | 'lost' | 'preempted'), max_lost,
-- backoff_ms, backoff_max_ms
-- Gives back a failed or lost attempt (see requeue). -> 'QUEUED' | 'FAILED', or false when the
-- epoch is stale or the request is queued or ended.
-- Replay: the record's 'requeued' names this epoch, kind and error: the replay answers what the
-- first run did and changes nothing.
local h = redis.call('HMGET', key('req', ARGV[2]), 'state', 'epoch', 'requeued')
if not h[1] then return false end
for _, outcome in ipairs({'QUEUED', 'FAILED'}) do
  if h[3] == table.concat({ARGV[3], ARGV[8], outcome, ARGV[6]}, '|') then return outcome end
end
if TERMINAL[h[1]] or h[1] == 'QUEUED' or h[2] ~= ARGV[3] then return false end
return requeue(ARGV[2], ARGV[6], ARGV[4], ARGV[8], {ARGV[5], ARGV[9], ARGV[10], ARGV[11]}, ARGV[7])
