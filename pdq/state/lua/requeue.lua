-- ARGS: id epoch now max_attempts error ttl kind max_lost backoff_ms backoff_max_ms
-- ARGV: prefix, id, epoch, now, max_attempts, error, ttl, kind ('failure' | 'lost' | 'preempted'), max_lost,
-- backoff_ms, backoff_max_ms
-- Gives back a failed or lost attempt (see requeue). -> 'QUEUED' | 'FAILED', or false when the
-- epoch is stale or the request is queued or ended.
-- Replay: the record's 'requeued' names this epoch, kind and error: the replay answers what the
-- first run did and changes nothing.
local h = redis.call('HMGET', key('req', A.id), 'state', 'epoch', 'requeued')
if not h[1] then return false end
for _, outcome in ipairs({'QUEUED', 'FAILED'}) do
  if h[3] == table.concat({A.epoch, A.kind, outcome, A.error}, '|') then return outcome end
end
if TERMINAL[h[1]] or h[1] == 'QUEUED' or h[2] ~= A.epoch then return false end
return requeue(A.id, A.error, A.now, A.kind, {A.max_attempts, A.max_lost, A.backoff_ms, A.backoff_max_ms}, A.ttl)
