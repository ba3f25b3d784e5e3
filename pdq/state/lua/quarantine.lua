-- ARGS: worker until_ms reason times now ttl
-- ARGV: prefix, worker id, until (ms), reason, quarantines so far (as read), now, ttl (ms)
-- Quarantines a worker until `until` (no new work while others can take it), if its count of
-- quarantines is still the one read (another scheduler may have done it meanwhile): ends its
-- streak and counts one more quarantine. The record expires ttl after the quarantine ends.
-- -> 1 when quarantined, 0 when the count had moved on
-- Replay: the count moved on with the first run: 0, nothing written.
local hk = key('health', A.worker)
if num(redis.call('HGET', hk, 'times'), 0) ~= tonumber(A.times) then return 0 end
redis.call('HSET', hk, 'until', A.until_ms, 'reason', A.reason, 'times', tonumber(A.times) + 1, 'streak', 0, 'peers', '')
redis.call('PEXPIRE', hk, math.max(0, tonumber(A.until_ms) - tonumber(A.now)) + tonumber(A.ttl))
return 1
