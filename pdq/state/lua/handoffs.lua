-- ARGS: event ttl | per hand-off outcome: worker id, the other side's worker id, ok
-- ARGV: prefix, event (this call's token: the batch id), ttl (ms), then per hand-off outcome:
-- worker id, the other side's worker id, ok (1 | 0)
-- Counts KV hand-offs per worker, in order: a failure adds one to the worker's streak and the
-- other side to its peers; a success ends the streak. -> per worker, in first-seen order,
-- {id, streak, distinct peers in the streak, quarantines so far, quarantined until (ms)}
-- Replay: each worker's record names this call's event: it is not counted again.
local seen, order = {}, {}
for i = TAIL, #ARGV, 3 do
  local w, peer, ok = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local hk = key('health', w)
  if seen[w] == nil then
    seen[w] = redis.call('HGET', hk, 'event') ~= A.event
    order[#order + 1] = w
    if seen[w] then redis.call('HSET', hk, 'event', A.event) end
  end
  if seen[w] then
    if ok then
      redis.call('HSET', hk, 'streak', 0, 'peers', '')
    else
      redis.call('HINCRBY', hk, 'streak', 1)
      local peers, has = {}, false
      for x in string.gmatch(redis.call('HGET', hk, 'peers') or '', '%S+') do
        peers[#peers + 1] = x
        has = has or x == peer
      end
      if not has and #peers < 8 then peers[#peers + 1] = peer end
      redis.call('HSET', hk, 'peers', table.concat(peers, ' '))
    end
    if redis.call('PTTL', hk) < tonumber(A.ttl) then redis.call('PEXPIRE', hk, A.ttl) end
  end
end
local out = {}
for _, w in ipairs(order) do
  local h = redis.call('HMGET', key('health', w), 'streak', 'peers', 'times', 'until')
  local n = 0
  for _ in string.gmatch(h[2] or '', '%S+') do n = n + 1 end
  out[#out + 1] = {w, num(h[1], 0), n, num(h[3], 0), num(h[4], 0)}
end
return out
