-- ARGS: cutoff | role names
-- ARGV: prefix, cutoff (ms), role1, role2, ...
-- The registry in one round trip: per role, the workers that heartbeat at or after the cutoff,
-- each with its hash (empty once it expired) and its hand-off record {until, reason, streak}
-- (see HANDOFFS); then the ids an operator drained.
-- -> {{{id, {field, value, ...}, {until, reason, streak}}, ...} per role..., {drained ids}}
-- Replay: read-only.
local out = {}
for r = TAIL, #ARGV do
  local rows = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', key('workers', ARGV[r]), A.cutoff, '+inf')) do
    local q = redis.call('HMGET', key('health', id), 'until', 'reason', 'streak')
    rows[#rows + 1] = {id, redis.call('HGETALL', key('worker', id)), {q[1] or '0', q[2] or '', q[3] or '0'}}
  end
  out[#out + 1] = rows
end
out[#out + 1] = redis.call('SMEMBERS', key('drained'))
return out
