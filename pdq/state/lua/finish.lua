-- ARGS: id state reason error now ttl epoch
-- ARGV: prefix, id, state, reason, error, now, ttl, epoch ('' = any)
-- Ends a request from outside its worker (cancel, timeout, failure; see pdq.state.ending); a timeout
-- only while the record's deadline has passed (lib.lua `moved_past`).
-- -> the state after the call (not terminal: it goes on); false when the request does not exist.
-- Replay: the request has ended: the replay answers its state (the one the first run wrote) and
-- writes nothing.
local h = redis.call('HMGET', key('req', A.id), 'state', 'epoch')
if not h[1] then return false end
if TERMINAL[h[1]] then return h[1] end
if A.epoch ~= '' and A.epoch ~= h[2] then return h[1] end
if moved_past(key('req', A.id), A.state, A.now) then return h[1] end  -- its deadline moved: it goes on
finish(A.id, A.state, A.reason, A.error, A.now, A.ttl)
return A.state
