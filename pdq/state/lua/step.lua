-- ARGS: now ttl | per run 10 values
-- ARGV: prefix, now, ttl, then per run 10 values (`pdq.state.store.StepArgs`):
-- id, epoch, first index ('' = no token), n tokens, token ids ("a,b,c"), their texts joined,
-- their texts' byte lengths ("1,0,3"), final state ('' = none), finish reason, the tokens'
-- log-probability records joined by "," ('' = none asked; `pdq.state.store.encode_logprobs`)
-- A run is the consecutive tokens of one request, written as one stream entry, then maybe its end.
-- Tokens at indices already written (a replay) are skipped; a gap is an error. A TIMED_OUT end
-- whose record's deadline has moved past `now` is not applied (lib.lua `moved_past`). -> per run
-- 1 (written) or 0 (stale epoch / already ended: drop the sequence)
-- Replay: its tokens are at indices already written (skipped), and a run that ended its request
-- finds it ended under the same epoch with the same state and reason: answered 1 again, nothing
-- written twice.
local function split(s)
  local out = {}
  for v in string.gmatch(s, '[^,]+') do out[#out + 1] = v end
  return out
end
local res = {}
for a = TAIL, #ARGV, 10 do
  local id = ARGV[a]
  local rk = key('req', id)
  local h = redis.call('HMGET', rk, 'state', 'epoch', 'n_out', 'finish_reason')
  if h[1] and TERMINAL[h[1]] and h[2] == ARGV[a + 1] and h[1] == ARGV[a + 7] and h[4] == ARGV[a + 8] then
    res[#res + 1] = 1  -- this run's own end, applied before: a replay
  elseif not h[1] or TERMINAL[h[1]] or h[2] ~= ARGV[a + 1] then
    res[#res + 1] = 0
  else
    if ARGV[a + 2] ~= '' then
      local first, n, n_out = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(h[3]) or 0
      if first > n_out then
        return redis.error_reply('token index gap: ' .. first .. ' > ' .. n_out)
      end
      local skip = n_out - first
      if skip < n then
        local ids, text, lens, lps = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], ARGV[a + 9]
        if skip > 0 then  -- a replay that goes past what was written: keep the new tokens only
          local all_ids, all_lens, at = split(ids), split(lens), 0
          for k = 1, skip do at = at + tonumber(all_lens[k]) end
          ids = table.concat(all_ids, ',', skip + 1)
          lens = table.concat(all_lens, ',', skip + 1)
          text = string.sub(text, at + 1)
          if lps ~= '' then lps = table.concat(split(lps), ',', skip + 1) end
        end
        if lps ~= '' then
          redis.call('XADD', key('req', id, 'out'), '*', 'i', n_out, 't', ids, 'x', text, 'l', lens, 'p', lps)
        else
          redis.call('XADD', key('req', id, 'out'), '*', 'i', n_out, 't', ids, 'x', text, 'l', lens)
        end
        redis.call('HSET', rk, 'n_out', first + n)
        if n_out == 0 then redis.call('HSET', rk, 'first_token_ms', A.now) end
      end
    end
    if ARGV[a + 7] ~= '' and not moved_past(rk, ARGV[a + 7], A.now) then
      finish(id, ARGV[a + 7], ARGV[a + 8], '', A.now, A.ttl, true)
    end
    res[#res + 1] = 1
  end
end
return res
