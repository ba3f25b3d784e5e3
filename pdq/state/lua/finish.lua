-- ARGV: prefix, id, state, reason, error, now, ttl, epoch ('' = any)
-- Ends a request from outside its worker (cancel, timeout, failure; see pdq.state.ending); a timeout
-- only while the record's deadline has passed (lib.lua `moved_past`).
-- -> the state after the call (not terminal: it goes on); false when the request does not exist.
-- Replay: the request has ended: the replay answers its state (the one the first run wrote) and
-- writes nothing.
local h = redis.call('HMGET', key('req', ARGV[2]), 'state', 'epoch')
if not h[1] then return false end
if TERMINAL[h[1]] then return h[1] end
if ARGV[8] ~= '' and ARGV[8] ~= h[2] then return h[1] end
if moved_past(key('req', ARGV[2]), ARGV[3], ARGV[6]) then return h[1] end  -- its deadline moved: it goes on
finish(ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
return ARGV[3]
