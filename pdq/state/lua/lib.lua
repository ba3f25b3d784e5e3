-- The shared part of every script: key names (mirroring Keys), the queue, fair-share counters,
-- leases and the one way a request ends. ARGV[1] is always the prefix. `TERMINAL` (the terminal
-- states) is put before this file by pdq.state.keys, generated from `pdq.state.request.State`.
local P = ARGV[1]

local function key(...) return table.concat({P, ...}, ':') end
local function num(x, default) return tonumber(x) or default end

-- A leading scheduler's write carries its epoch (pdq.state.keys: 'leader:epoch'); once another
-- scheduler has been elected the write is refused (the script answers 'FENCED', changing
-- nothing). '0': an unfenced write (a tool or a test, with no election).
local FENCED = 'FENCED'

-- A timeout reached through a copy of the deadline (a worker's, the gateway's) ends a request only
-- if the deadline its record holds now has passed: an operator may have moved it after the caller
-- last read it. -> true when the deadline was moved past `now`
local function moved_past(rk, state, now)
  if state ~= 'TIMED_OUT' then return false end
  local d = tonumber(redis.call('HGET', rk, 'deadline_ms') or '') or 0
  return d > tonumber(now)
end
local function deposed(epoch)
  return epoch ~= '0' and redis.call('GET', key('leader', 'epoch')) ~= epoch
end

-- A tenant's VTC counter moves by delta; the backlog keeps a copy as its score.
local function vtc_add(tier, tenant, delta)
  local c = redis.call('HINCRBYFLOAT', key('vtc', tier), tenant, delta)
  redis.call('ZADD', key('backlog', tier), 'XX', c, tenant)
end

local function tenant_add(hash, tenant, n, tokens)
  if redis.call('HINCRBY', hash, 'n:' .. tenant, n) <= 0 then
    redis.call('HDEL', hash, 'n:' .. tenant, 'tokens:' .. tenant)
  else
    redis.call('HINCRBY', hash, 'tokens:' .. tenant, tokens)
  end
end

local function load_add(tier, tenant, n, tokens)
  local load = key('load')
  redis.call('HINCRBY', load, 'n', n)
  redis.call('HINCRBY', load, 'tokens', tokens)
  tenant_add(load, tenant, n, tokens)
  tenant_add(key('depth', tier), tenant, n, tokens)
end

-- Puts a recorded request in its tenant's queue. A tenant that joins the backlog is lifted to
-- the lowest backlogged counter (or the floor), so it cannot bank credit while idle.
local function enqueue(id, tier, tenant, score, cost)
  if redis.call('ZADD', key('q', tier, tenant), score, id) == 0 then return end
  load_add(tier, tenant, 1, cost)
  local backlog = key('backlog', tier)
  if redis.call('ZSCORE', backlog, tenant) then return end
  local vtc = key('vtc', tier)
  local c = redis.call('HGET', vtc, tenant) or '0'
  local low = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')[2]
  local floor = low or redis.call('GET', key('vtc', tier, 'floor')) or '0'
  if tonumber(floor) > tonumber(c) then c = floor end
  redis.call('HSET', vtc, tenant, c)
  redis.call('ZADD', backlog, c, tenant)
end

-- Takes a request out of its tenant's queue; a tenant whose queue empties leaves the backlog.
local function unqueue(id, tier, tenant, cost)
  local q = key('q', tier, tenant)
  if redis.call('ZREM', q, id) == 0 then return end
  load_add(tier, tenant, -1, -num(cost, 0))
  if redis.call('EXISTS', q) == 1 then return end
  local backlog = key('backlog', tier)
  redis.call('ZREM', backlog, tenant)
  if redis.call('ZCARD', backlog) == 0 then
    redis.call('SET', key('vtc', tier, 'floor'), redis.call('HGET', key('vtc', tier), tenant) or '0')
  end
end

-- Charges a request's tokens to its tenant, once (retries are not charged again).
local function charge(rk, tier, tenant, cost, default_weight)
  if redis.call('HEXISTS', rk, 'charge_w') == 1 then return end
  local w = num(redis.call('HGET', key('tenant', tenant), 'weight'), default_weight)
  if w <= 0 then w = default_weight end
  local c = num(cost, 0) / w
  vtc_add(tier, tenant, c)
  redis.call('HSET', rk, 'charge', c, 'charge_w', w)
end

-- Gives back the charge of tokens a request was charged for but did not produce.
local function settle(rk, tier, tenant)
  local h = redis.call('HMGET', rk, 'charge_w', 'max_tokens', 'n_out')
  if not h[1] then return end
  local unused = num(h[2], 0) - num(h[3], 0)
  if unused > 0 then vtc_add(tier, tenant, -unused / tonumber(h[1])) end
end

-- Ends the current attempt's leases: no worker holds the request any more.
local function release(id, rk)
  local h = redis.call('HMGET', rk, 'lease_prefill', 'lease_decode')
  if h[1] then
    redis.call('SREM', key('held', h[1]), id)
    redis.call('HINCRBY', key('load'), 'running', -1)
    local per = 'running:' .. (redis.call('HGET', rk, 'tenant') or '')
    if redis.call('HINCRBY', key('load'), per, -1) <= 0 then redis.call('HDEL', key('load'), per) end
  end
  if h[2] then redis.call('SREM', key('held', h[2]), id) end
  redis.call('HDEL', rk, 'lease_prefill', 'lease_decode')
  redis.call('ZREM', key('leases'), id)
end

-- Keeps an ended request listed (p:index) as long as its record lives, and unlists requests
-- whose records have expired (ended more than ttl seconds ago), a few per call.
local function unlist_later(id, tenant, now, ttl)
  local ended = key('ended')
  redis.call('ZADD', ended, now, id .. '\n' .. tenant)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', ended, '-inf', tonumber(now) - tonumber(ttl) * 1000, 'LIMIT', 0, 16)) do
    local nl = string.find(m, '\n', 1, true)
    local old = string.sub(m, 1, nl - 1)
    redis.call('ZREM', key('index'), old)
    redis.call('ZREM', key('index', string.sub(m, nl + 1)), old)
    redis.call('ZREM', ended, m)
  end
end

-- Records the one terminal state of a live request, closes its output stream, frees its queue
-- entry, leases and deadline, settles its charge, sets expiry and tells the workers (unless
-- `quiet`: the worker ending it in its own step, the only one holding this attempt).
local function finish(id, state, reason, err, now, ttl, quiet)
  local rk = key('req', id)
  -- h[5..9]: the usage fields its end entry carries (gateway.results.USAGE_FIELDS, in order)
  local h = redis.call('HMGET', rk, 'state', 'tier', 'tenant', 'cost',
                       'created_ms', 'prompt_tokens', 'n_out', 'dispatched_ms', 'first_token_ms')
  if h[1] == 'QUEUED' then unqueue(id, h[2], h[3], h[4]) end
  settle(rk, h[2], h[3])
  release(id, rk)
  redis.call('HSET', rk, 'state', state, 'finish_reason', reason, 'error', err, 'finished_ms', now)
  local ok = key('req', id, 'out')
  redis.call('XADD', ok, '*', 'done', state, 'r', reason, 'e', err,
             'u', table.concat({h[5] or '', h[6] or '', h[7] or '', h[8] or '', h[9] or '', now}, ','))
  redis.call('ZREM', key('deadlines'), id)
  redis.call('SREM', key('live', h[3]), id)
  unlist_later(id, h[3], now, ttl)
  redis.call('EXPIRE', rk, ttl)
  redis.call('EXPIRE', ok, ttl)
  if not quiet then redis.call('PUBLISH', key('cancel'), id) end
end

-- A worker id added to a request's avoid list (its latest 8 distinct ids, space-separated).
local function avoid_add(rk, w)
  if not w or w == '' then return end
  local list = {}
  for x in string.gmatch(redis.call('HGET', rk, 'avoid') or '', '%S+') do
    if x ~= w then list[#list + 1] = x end
  end
  list[#list + 1] = w
  while #list > 8 do table.remove(list, 1) end
  redis.call('HSET', rk, 'avoid', table.concat(list, ' '))
end

-- Ends a live, non-queued request's attempt. kind 'failure' (the request's own: a failed
-- hand-off, an error on a worker) counts towards max_attempts, puts the attempt's workers on the
-- request's avoid list and holds it back backoff_ms (doubling per failure, at most
-- backoff_max_ms: retry_at); kind 'lost' (infrastructure: its worker died or shut down, its lease
-- expired) counts towards max_lost only; kind 'preempted' (a decode worker made room for a better
-- tier) counts nothing but 'preempted'. Back to its old place in its tenant's queue under a new
-- epoch (so the old attempt's writes are rejected), or FAILED when its bound is reached. What it
-- did is kept in 'requeued' (epoch|kind|outcome|error), so a replay of the same call can answer
-- the same. lim: {max_attempts, max_lost, backoff_ms, backoff_max_ms}
local function requeue(id, err, now, kind, lim, ttl)
  local rk = key('req', id)
  local h = redis.call('HMGET', rk, 'epoch', 'tier', 'tenant', 'score', 'cost', 'lease_prefill', 'lease_decode')
  local outcome, why = 'QUEUED', err
  if kind == 'preempted' then
    redis.call('HINCRBY', rk, 'preempted', 1)
  elseif kind == 'lost' then
    local n = redis.call('HINCRBY', rk, 'lost', 1)
    if n >= tonumber(lim[2]) then
      outcome, why = 'FAILED', err .. ' (' .. n .. ' attempts lost to worker or Redis trouble: max_lost_attempts)'
    end
  else
    local n = redis.call('HINCRBY', rk, 'failures', 1)
    if n >= tonumber(lim[1]) then
      outcome = 'FAILED'
    else
      avoid_add(rk, h[6])
      avoid_add(rk, h[7])
      local wait = math.min(tonumber(lim[4]), tonumber(lim[3]) * 2 ^ (n - 1))
      redis.call('HSET', rk, 'retry_at', tonumber(now) + math.floor(wait))
    end
  end
  redis.call('HSET', rk, 'requeued', table.concat({h[1] or '', kind, outcome, err}, '|'))
  if outcome == 'FAILED' then
    finish(id, 'FAILED', 'error', why, now, ttl)
    return 'FAILED'
  end
  release(id, rk)
  redis.call('HINCRBY', rk, 'epoch', 1)
  redis.call('HSET', rk, 'state', 'QUEUED', 'error', err)
  enqueue(id, h[2], h[3], h[4], h[5])
  redis.call('PUBLISH', key('queued'), id)
  return 'QUEUED'
end
