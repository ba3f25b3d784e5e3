-- ARGS: id
-- ARGV: prefix, scheduler id
-- A stopping leader gives the dispatch lease up, so a standby takes it at its next try instead
-- of after the lease runs out. -> 1 if it held the lease, else 0
-- Replay: the first run freed the lease: 0.
local cur = redis.call('GET', key('leader'))
if cur and string.sub(cur, string.find(cur, ' ', 1, true) + 1) == A.id then
  redis.call('DEL', key('leader'))
  return 1
end
return 0
