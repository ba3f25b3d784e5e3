"""Every Redis key and Lua script of pdq, in one place.

Layout (prefix `p`, default "pdq"):
  p:req:{id}              hash   the request record (fields below); expires result_ttl_s after it ends
  p:req:{id}:out          stream its output: entries of tokens {i, t, x, l}, then {done, r, e}
                          (i: first index; t: token ids, comma-separated; x: their text;
                          l: each token's text length in bytes, comma-separated; one entry
                          per token unless a worker wrote several at once: stream_interval)
  p:idem:{tenant}:{k}     string client idempotency key -> request id
  p:q:{tier}:{tenant}     zset   one tenant's queued request ids in one tier, score = its order
                                 (the intra-tenant policy's score, fixed at submit, kept on requeue)
  p:backlog:{tier}        zset   tenants with queued requests in the tier, score = their VTC counter
  p:vtc:{tier}            hash   tenant -> virtual token counter (tokens served / weight), cluster-wide
  p:vtc:{tier}:floor      string the counter of the last tenant that left an emptied backlog
  p:load                  hash   queued work: n, tokens, n:{tenant}, tokens:{tenant}
                                 (tokens of a request = prompt + max_tokens); running, running:{tenant}
                                 (claimed, not ended)
  p:depth:{tier}          hash   queued work of the tier: n:{tenant}, tokens:{tenant}
  p:live:{tenant}         set    ids of the tenant's requests that have not ended
  p:paused                set    "tier:{name}" / "tenant:{name}": not dispatched (their requests stay queued)
  p:deadlines             zset   non-terminal request ids with a deadline, score = deadline (ms)
  p:leases                zset   ids in PREFILLING/TRANSFERRING, score = prefill lease expiry (ms)
  p:held:{worker}         set    ids of the current attempts a worker takes part in (prefill or decode)
  p:seq                   int    arrival sequence counter
  p:tenant:{name}         hash   tenant policy: weight, tier (best allowed), max_queued, max_queued_tokens
  p:tenants               set    tenants with a policy
  p:index                 zset   every request id by arrival seq (ListRequests, newest first); an
                                 ended request leaves it result_ttl_s after it ends, with its record
  p:index:{tenant}        zset   the same for one tenant
  p:ended                 zset   ended requests as "{id}<newline>{tenant}", score = finished_ms (prunes the index)
  p:workers:{role}        zset   worker id -> last heartbeat (ms)
  p:worker:{id}           hash   worker facts: role, address, free_slots, ...
  p:drained               set    worker ids an operator drained: no new work until undrained (the
                                 worker's own heartbeat never clears it; reaping the worker does)
  p:health:{id}           hash   a worker's KV hand-off record (HANDOFFS, QUARANTINE): streak (failed
                                 hand-offs in a row), peers (the other sides of those failures), event
                                 (the last call counted), times (quarantines so far), until (ms) and
                                 reason of its quarantine; expires an hour after its last change
  p:cancel                pubsub channel: ids of requests that just ended elsewhere (cancel, timeout,
                          failure; not a worker's own end in its step), for workers to drop
  p:heartbeats            pubsub channel: ids of workers that just heartbeat (e.g. a KV slot freed),
                          while requests are queued
  p:deadline              pubsub channel: "{id} {deadline_ms}" when an operator moved a deadline
  p:queued                pubsub channel: ids of requests put back in the queue (a requeue), or ""
                          when an operator resumed a queue: wakes a scheduler whose queue was empty

Record fields: id, spec (RequestSpec protobuf bytes), tenant, tier, state, epoch, seq, score,
created_ms, deadline_ms, prompt_tokens, max_tokens, cost (prompt + max_tokens), n_out,
dispatched_ms (first dispatch), first_token_ms, finished_ms, finish_reason, error, attempts
(claims), prefill_worker / decode_worker (addresses, for people), lease_prefill / lease_decode
(worker ids holding the current attempt), charge / charge_w (VTC charge of the request and the
weight used), content_hash / client_request_id (what the client asked for, and its id for it),
submit (the token of the SUBMIT call that wrote it), claim (the token of the CLAIM call that made
the current attempt), failures / lost (attempts that failed / were lost to infrastructure),
retry_at (ms: not dispatched before, after a failure), avoid (ids of the workers of its failed
attempts, space-separated, the latest 8), requeued (what the last requeue did, for its replay).

Every script is safe to run twice in a row with the same arguments: a client of `pdq.redisconn`
re-sends a command whose reply was lost, so the first run may have been applied. Each script's
comment says why its replay is harmless; tests/test_replay.py runs each one twice.

Every multi-key change is one Lua script, so it is atomic. A write carrying a lease epoch other
than the record's current one is rejected (a stale worker cannot write). The scripts derive the
keys of a request's tenant queue, counters and leases from the prefix (ARGV[1]) and the record,
so pdq needs one Redis (standalone or Sentinel), not Redis Cluster.

Fair-share accounting (VTC): a request is charged (prompt + max_tokens) / weight when it is first
claimed, and the unused part (max_tokens - tokens produced) is given back when it ends, so its net
charge is (prompt + output) / weight, once, whatever its retries. A tenant whose queue was empty
is lifted, as it joins the backlog, to the lowest counter of the backlogged tenants (or the floor
when none is), so idle time banks no credit.
"""

from dataclasses import dataclass

from pdq.request import TERMINAL


@dataclass(frozen=True)
class Keys:
    prefix: str = "pdq"

    def request(self, rid: str) -> str:
        return f"{self.prefix}:req:{rid}"

    def output(self, rid: str) -> str:
        return f"{self.prefix}:req:{rid}:out"

    def idempotency(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    def queue(self, tier: str, tenant: str) -> str:
        return f"{self.prefix}:q:{tier}:{tenant}"

    def backlog(self, tier: str) -> str:
        return f"{self.prefix}:backlog:{tier}"

    def vtc(self, tier: str) -> str:
        return f"{self.prefix}:vtc:{tier}"

    def vtc_floor(self, tier: str) -> str:
        return f"{self.prefix}:vtc:{tier}:floor"

    @property
    def load(self) -> str:
        return f"{self.prefix}:load"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}:deadlines"

    @property
    def leases(self) -> str:
        return f"{self.prefix}:leases"

    def held(self, worker_id: str) -> str:
        return f"{self.prefix}:held:{worker_id}"

    @property
    def seq(self) -> str:
        return f"{self.prefix}:seq"

    def tenant(self, name: str) -> str:
        return f"{self.prefix}:tenant:{name}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    def depth(self, tier: str) -> str:
        return f"{self.prefix}:depth:{tier}"

    def live(self, tenant: str) -> str:
        return f"{self.prefix}:live:{tenant}"

    @property
    def paused(self) -> str:
        return f"{self.prefix}:paused"

    def workers(self, role: str) -> str:
        return f"{self.prefix}:workers:{role}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def heartbeat_channel(self) -> str:
        return f"{self.prefix}:heartbeats"

    @property
    def deadline_channel(self) -> str:
        return f"{self.prefix}:deadline"

    @property
    def queued_channel(self) -> str:
        return f"{self.prefix}:queued"

    def index(self, tenant: str = "") -> str:
        return f"{self.prefix}:index:{tenant}" if tenant else f"{self.prefix}:index"

    @property
    def ended(self) -> str:
        return f"{self.prefix}:ended"

    @property
    def drained(self) -> str:
        return f"{self.prefix}:drained"

    def health(self, worker_id: str) -> str:
        return f"{self.prefix}:health:{worker_id}"


# The shared part of every script: key names (mirroring Keys), the queue, fair-share counters,
# leases and the one way a request ends. ARGV[1] is always the prefix. The terminal states come
# from `pdq.request.State` (tests/test_keys_states.py checks every state name the scripts use).
_LIB = """
local P = ARGV[1]
local TERMINAL = {""" + ", ".join(f"{s.value}=true" for s in sorted(TERMINAL)) + """}

local function key(...) return table.concat({P, ...}, ':') end
local function num(x, default) return tonumber(x) or default end

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
  redis.call('ZADD', ended, now, id .. '\\n' .. tenant)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', ended, '-inf', tonumber(now) - tonumber(ttl) * 1000, 'LIMIT', 0, 16)) do
    local nl = string.find(m, '\\n', 1, true)
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
"""

# ARGV: prefix, id, spec, tenant, tier, now, deadline_ms, prompt_tokens, max_tokens, seq (0 = next),
#       score ('' = seq), idem key ('' = none), idem_ttl, max_queued, max_queued_tokens,
#       tenant_max_queued, tenant_max_queued_tokens, token (this call's), content_hash ('' = none),
#       client_request_id
# Bounds count a scope's queued requests and tokens (prompt + max_tokens); a scope with nothing
# queued always admits, so no single request is refused forever. An idempotency key (or request id)
# that names a request with another content hash is a conflict: a different request under a reused id.
# -> {1, id} created | {0, existing id} idempotent retry | {-1, reason, tokens to drain} rejected
#    | {-2, existing id} conflict
# Replay: the record exists and carries this call's token, so the replay answers {1, id} again
# (a client's retry comes with another token and gets {0, id}); nothing is written twice.
SUBMIT = _LIB + """
local id, tenant, tier = ARGV[2], ARGV[4], ARGV[5]
local idem, token, hash = ARGV[12], ARGV[18], ARGV[19]
local function known(rid)
  local h = redis.call('HMGET', key('req', rid), 'state', 'submit', 'content_hash')
  if not h[1] then return nil end
  if h[2] == token then return {1, rid} end
  if hash ~= '' and h[3] and h[3] ~= '' and h[3] ~= hash then return {-2, rid} end
  return {0, rid}
end
if idem ~= '' then
  local existing = redis.call('GET', key('idem', tenant, idem))
  local got = existing and known(existing)
  if got then return got end
end
local got = known(id)
if got then return got end
local cost = tonumber(ARGV[8]) + tonumber(ARGV[9])
local l = redis.call('HMGET', key('load'), 'n:' .. tenant, 'tokens:' .. tenant, 'n', 'tokens')
local checks = {{'TENANT_QUEUE_FULL', 'TENANT_QUEUE_TOKENS_FULL', l[1], l[2], ARGV[16], ARGV[17]},
                {'QUEUE_FULL', 'QUEUE_TOKENS_FULL', l[3], l[4], ARGV[14], ARGV[15]}}
for _, c in ipairs(checks) do
  local n, tokens = num(c[3], 0), num(c[4], 0)
  if n > 0 then
    if n + 1 > tonumber(c[5]) then return {-1, c[1], math.ceil(tokens / n)} end
    if tokens + cost > tonumber(c[6]) then return {-1, c[2], tokens + cost - tonumber(c[6])} end
  end
end
local seq = tonumber(ARGV[10])
if seq == 0 then seq = redis.call('INCR', key('seq')) end
local score = ARGV[11]
if score == '' then score = seq end
local rec = {'id', id, 'spec', ARGV[3], 'tenant', tenant, 'tier', tier, 'state', 'QUEUED', 'epoch', 0, 'seq', seq,
  'score', score, 'created_ms', ARGV[6], 'deadline_ms', ARGV[7], 'prompt_tokens', ARGV[8], 'max_tokens', ARGV[9],
  'cost', cost, 'n_out', 0, 'attempts', 0, 'submit', token}
if hash ~= '' then rec[#rec + 1] = 'content_hash'; rec[#rec + 1] = hash end
if ARGV[20] ~= '' then rec[#rec + 1] = 'client_request_id'; rec[#rec + 1] = ARGV[20] end
redis.call('HSET', key('req', id), unpack(rec))
enqueue(id, tier, tenant, score, cost)
redis.call('SADD', key('live', tenant), id)
redis.call('ZADD', key('index'), seq, id)
redis.call('ZADD', key('index', tenant), seq, id)
if tonumber(ARGV[7]) > 0 then redis.call('ZADD', key('deadlines'), ARGV[7], id) end
if idem ~= '' then redis.call('SET', key('idem', tenant, idem), id, 'EX', ARGV[13]) end
return {1, id}
"""

# ARGV: prefix, now, prefill worker id, prefill address, lease expiry (ms), default weight, token
#       (this call's: the batch id), then per request: id, decode worker id
# Moves each still-QUEUED request to PREFILLING under a new epoch, leased to both workers, and
# charges its tenant. -> per request {epoch, spec}, {0, ''} where it was no longer queued
# Replay: a request this call already claimed is PREFILLING with this call's token on its record
# ('claim'): the replay answers its epoch and spec again and changes nothing (its reply was lost,
# so no worker has it yet). Without the token a replayed claim would see the requests no longer
# queued, and the dispatcher would drop them until their lease expired.
CLAIM = _LIB + """
local out = {}
for i = 8, #ARGV, 2 do
  local id, decode = ARGV[i], ARGV[i + 1]
  local rk = key('req', id)
  local h = redis.call('HMGET', rk, 'state', 'tier', 'tenant', 'cost', 'claim', 'epoch')
  if h[1] == 'QUEUED' then
    local ep = redis.call('HINCRBY', rk, 'epoch', 1)
    redis.call('HINCRBY', rk, 'attempts', 1)
    redis.call('HSETNX', rk, 'dispatched_ms', ARGV[2])
    redis.call('HSET', rk, 'state', 'PREFILLING', 'prefill_worker', ARGV[4],
      'lease_prefill', ARGV[3], 'lease_decode', decode, 'claim', ARGV[7])
    charge(rk, h[2], h[3], h[4], tonumber(ARGV[6]))
    unqueue(id, h[2], h[3], h[4])
    redis.call('SADD', key('held', ARGV[3]), id)
    redis.call('SADD', key('held', decode), id)
    redis.call('HINCRBY', key('load'), 'running', 1)
    redis.call('HINCRBY', key('load'), 'running:' .. h[3], 1)
    redis.call('ZADD', key('leases'), ARGV[5], id)
    out[#out + 1] = {ep, redis.call('HGET', rk, 'spec')}
  elseif h[1] == 'PREFILLING' and h[5] == ARGV[7] then
    out[#out + 1] = {tonumber(h[6]), redis.call('HGET', rk, 'spec')}
  else
    out[#out + 1] = {0, ''}
  end
end
return out
"""

# ARGV: prefix, id, epoch, now, max_attempts, error, ttl, kind ('failure' | 'lost' | 'preempted'), max_lost,
#       backoff_ms, backoff_max_ms
# Gives back a failed or lost attempt (see requeue). -> 'QUEUED' | 'FAILED', or false when the
# epoch is stale or the request is queued or ended.
# Replay: the record's 'requeued' names this epoch, kind and error: the replay answers what the
# first run did and changes nothing.
REQUEUE = _LIB + """
local h = redis.call('HMGET', key('req', ARGV[2]), 'state', 'epoch', 'requeued')
if not h[1] then return false end
for _, outcome in ipairs({'QUEUED', 'FAILED'}) do
  if h[3] == table.concat({ARGV[3], ARGV[8], outcome, ARGV[6]}, '|') then return outcome end
end
if TERMINAL[h[1]] or h[1] == 'QUEUED' or h[2] ~= ARGV[3] then return false end
return requeue(ARGV[2], ARGV[6], ARGV[4], ARGV[8], {ARGV[5], ARGV[9], ARGV[10], ARGV[11]}, ARGV[7])
"""

# ARGV: prefix, id, epoch, state, field1, value1, ...
# Moving to DECODING ends the prefill lease (the decode worker's heartbeat covers it from then).
# -> {1, deadline_ms} when moved (the record's deadline: an operator may have moved it since the
# spec the worker holds was written, and a worker can miss that notice), 0 when the epoch is stale
# or the request ended
# Replay: writes the same state and fields again under the same epoch and answers 1 (the worker
# that sent it waits for the reply, so nothing of this attempt moved it on meanwhile); if the
# request ended or was requeued in between, it answers 0 as any late call would.
TRANSITION = _LIB + """
local rk = key('req', ARGV[2])
local h = redis.call('HMGET', rk, 'state', 'epoch')
if not h[1] or TERMINAL[h[1]] or h[2] ~= ARGV[3] then return 0 end
redis.call('HSET', rk, 'state', ARGV[4])
for i = 5, #ARGV, 2 do redis.call('HSET', rk, ARGV[i], ARGV[i + 1]) end
if ARGV[4] == 'DECODING' then redis.call('ZREM', key('leases'), ARGV[2]) end
return {1, redis.call('HGET', rk, 'deadline_ms') or '0'}
"""

# ARGV: prefix, now, ttl, then per run 10 values (`pdq.store.StepArgs`):
#       id, epoch, first index ('' = no token), n tokens, token ids ("a,b,c"), their texts joined,
#       their texts' byte lengths ("1,0,3"), final state ('' = none), finish reason, the tokens'
#       log-probability records joined by "," ('' = none asked; `pdq.store.encode_logprobs`)
# A run is the consecutive tokens of one request, written as one stream entry, then maybe its end.
# Tokens at indices already written (a replay) are skipped; a gap is an error. -> per run 1
# (written) or 0 (stale epoch / already ended: drop the sequence)
# Replay: its tokens are at indices already written (skipped), and a run that ended its request
# finds it ended under the same epoch with the same state and reason: answered 1 again, nothing
# written twice.
STEP = _LIB + """
local function split(s)
  local out = {}
  for v in string.gmatch(s, '[^,]+') do out[#out + 1] = v end
  return out
end
local res = {}
for a = 4, #ARGV, 10 do
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
        if n_out == 0 then redis.call('HSET', rk, 'first_token_ms', ARGV[2]) end
      end
    end
    if ARGV[a + 7] ~= '' then
      finish(id, ARGV[a + 7], ARGV[a + 8], '', ARGV[2], ARGV[3], true)
    end
    res[#res + 1] = 1
  end
end
return res
"""

# ARGV: prefix, id, state, reason, error, now, ttl, epoch ('' = any)
# Ends a request from outside its worker (cancel, timeout, failure; see pdq.ending).
# -> the state after the call; false when the request does not exist.
# Replay: the request has ended: the replay answers its state (the one the first run wrote) and
# writes nothing.
FINISH = _LIB + """
local h = redis.call('HMGET', key('req', ARGV[2]), 'state', 'epoch')
if not h[1] then return false end
if TERMINAL[h[1]] then return h[1] end
if ARGV[8] ~= '' and ARGV[8] ~= h[2] then return h[1] end
finish(ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
return ARGV[3]
"""

# ARGV: prefix, now, limit, ttl
# Ends live requests whose deadline has passed, in any state. -> how many it looked at
# Replay: the requests the first run ended left the deadline set: it finds only what came due
# since (a sweep's answer counts what that run did).
EXPIRE_DEADLINES = _LIB + """
local due = redis.call('ZRANGEBYSCORE', key('deadlines'), '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(due) do
  local state = redis.call('HGET', key('req', id), 'state')
  if state and not TERMINAL[state] then
    finish(id, 'TIMED_OUT', 'timeout', 'deadline exceeded', ARGV[2], ARGV[4])
  else
    redis.call('ZREM', key('deadlines'), id)
  end
end
return #due
"""

# ARGV: prefix, worker id, now, max_attempts, ttl, max_lost
# A worker stopped heartbeating: every current attempt it takes part in is lost (requeue kind
# 'lost'; a prefill worker's only while the request is still in its hands). -> {requeued, failed}
# Replay: the first run emptied the worker's held set: nothing left to do, {0, 0}.
REAP_WORKER = _LIB + """
local w = ARGV[2]
local held = key('held', w)
local requeued, failed = 0, 0
for _, id in ipairs(redis.call('SMEMBERS', held)) do
  local h = redis.call('HMGET', key('req', id), 'state', 'lease_prefill', 'lease_decode')
  local s = h[1]
  if s and not TERMINAL[s] and s ~= 'QUEUED'
      and (h[3] == w or (h[2] == w and (s == 'PREFILLING' or s == 'TRANSFERRING'))) then
    if requeue(id, 'worker ' .. w .. ' stopped heartbeating', ARGV[3], 'lost',
               {ARGV[4], ARGV[6], 0, 0}, ARGV[5]) == 'QUEUED' then
      requeued = requeued + 1
    else
      failed = failed + 1
    end
  end
end
redis.call('DEL', held)
return {requeued, failed}
"""

# ARGV: prefix, now, max_attempts, ttl, limit, max_lost
# Gives back requests whose prefill lease expired (claimed, never handed off: e.g. the scheduler
# died before sending the batch, or a worker dropped it): lost attempts. -> {requeued, failed}
# Replay: the first run took them off the lease set: nothing left to do, {0, 0}.
EXPIRE_LEASES = _LIB + """
local requeued, failed = 0, 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', key('leases'), '-inf', ARGV[2], 'LIMIT', 0, ARGV[5])) do
  local s = redis.call('HGET', key('req', id), 'state')
  if s == 'PREFILLING' or s == 'TRANSFERRING' then
    if requeue(id, 'prefill lease expired', ARGV[2], 'lost', {ARGV[3], ARGV[6], 0, 0}, ARGV[4]) == 'QUEUED' then
      requeued = requeued + 1
    else
      failed = failed + 1
    end
  else
    redis.call('ZREM', key('leases'), id)
  end
end
return {requeued, failed}
"""

# ARGV: prefix, max tenants per tier, max requests per tenant, now, tier1, tier2, ...
# A bounded, read-only view of the queue: per tier, the backlogged tenants with the lowest
# counters, each with its weight ('' = default) and the head of its queue. Paused tiers and
# tenants are left out; so are requests held back after a failure (retry_at in the future): the
# answer ends with the earliest such retry_at (0 = none), when the dispatcher must look again.
# -> {per tier {{tenant, counter, weight, {id, prompt_tokens, max_tokens, created_ms, deadline_ms,
#    avoid, ...}}, ...}, ..., next retry_at}
# Replay: read-only.
SNAPSHOT = _LIB + """
local max_tenants, max_heads, now = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local paused = key('paused')
local next_retry = 0

local function heads_of(tier, tenant)
  local heads, got, from = {}, 0, 0
  local q = key('q', tier, tenant)
  while got < max_heads and from < 4 * max_heads do  -- past held-back requests, a bounded way
    local ids = redis.call('ZRANGE', q, from, from + max_heads - 1)
    for _, id in ipairs(ids) do
      local h = redis.call('HMGET', key('req', id), 'prompt_tokens', 'max_tokens', 'created_ms', 'deadline_ms',
                           'retry_at', 'avoid')
      local at = tonumber(h[5]) or 0
      if h[1] and at > now then
        if next_retry == 0 or at < next_retry then next_retry = at end
      elseif h[1] and got < max_heads then
        heads[#heads + 1] = id
        for j = 1, 4 do heads[#heads + 1] = h[j] end
        heads[#heads + 1] = h[6] or ''
        got = got + 1
      end
    end
    if #ids < max_heads then break end
    from = from + max_heads
  end
  return heads
end

local out = {}
for t = 5, #ARGV do
  local tier = ARGV[t]
  local tenants = {}
  if redis.call('SISMEMBER', paused, 'tier:' .. tier) == 0 then
    local rows = redis.call('ZRANGE', key('backlog', tier), 0, max_tenants + redis.call('SCARD', paused) - 1, 'WITHSCORES')
    for i = 1, #rows, 2 do
      local tenant = rows[i]
      if #tenants < max_tenants and redis.call('SISMEMBER', paused, 'tenant:' .. tenant) == 0 then
        local weight = redis.call('HGET', key('tenant', tenant), 'weight') or ''
        tenants[#tenants + 1] = {tenant, rows[i + 1], weight, heads_of(tier, tenant)}
      end
    end
  end
  out[#out + 1] = tenants
end
out[#out + 1] = next_retry
return out
"""

# ARGV: prefix, tenant, reason, now, ttl
# Cancels every live request of a tenant, in any state. -> how many
# Replay: the requests the first run ended left the tenant's live set: it cancels only what
# was submitted since (a sweep's answer counts what that run did).
CANCEL_TENANT = _LIB + """
local n = 0
for _, id in ipairs(redis.call('SMEMBERS', key('live', ARGV[2]))) do
  local state = redis.call('HGET', key('req', id), 'state')
  if state and not TERMINAL[state] then
    finish(id, 'CANCELLED', 'cancelled', ARGV[3], ARGV[4], ARGV[5])
    n = n + 1
  else
    redis.call('SREM', key('live', ARGV[2]), id)
  end
end
return n
"""

# ARGV: prefix, id, deadline_ms (absolute)
# Moves a live request's deadline (its order score is kept): the scheduler's janitor enforces it,
# and workers running the request are told on the deadline channel.
# -> the request's state; false when it does not exist
# Replay: sets the same deadline again; workers hear the same deadline twice (they keep it).
SET_DEADLINE = _LIB + """
local rk = key('req', ARGV[2])
local state = redis.call('HGET', rk, 'state')
if not state then return false end
if TERMINAL[state] then return state end
redis.call('HSET', rk, 'deadline_ms', ARGV[3])
redis.call('ZADD', key('deadlines'), ARGV[3], ARGV[2])
redis.call('PUBLISH', key('deadline'), ARGV[2] .. ' ' .. ARGV[3])
return state
"""

# ARGV: prefix, tenant ('' = all), state ('' = any), tier ('' = any), limit,
#       cursor (list below this arrival seq; '' = from the newest), most index entries to look at
# Requests newest first, filtered. Looks at a bounded number of entries, so a page may be short;
# the cursor goes on from the last entry looked at. Entries whose record expired are dropped.
# -> {ids, next cursor ('' = no more)}
# Replay: its only writes drop index entries of expired records, which stay dropped.
LIST_REQUESTS = _LIB + """
local idx = key('index')
if ARGV[2] ~= '' then idx = key('index', ARGV[2]) end
local limit, budget = tonumber(ARGV[5]), tonumber(ARGV[7])
local top = '+inf'
if ARGV[6] ~= '' then top = '(' .. ARGV[6] end
local out, last = {}, nil
while #out < limit and budget > 0 do
  local rows = redis.call('ZREVRANGEBYSCORE', idx, top, '-inf', 'WITHSCORES', 'LIMIT', 0, math.min(budget, 256))
  if #rows == 0 then return {out, ''} end
  for i = 1, #rows, 2 do
    local id = rows[i]
    last = rows[i + 1]
    budget = budget - 1
    local h = redis.call('HMGET', key('req', id), 'state', 'tier')
    if not h[1] then
      redis.call('ZREM', idx, id)
    elseif (ARGV[3] == '' or h[1] == ARGV[3]) and (ARGV[4] == '' or h[2] == ARGV[4]) then
      out[#out + 1] = id
      if #out == limit then break end
    end
  end
  top = '(' .. last
end
if #redis.call('ZREVRANGEBYSCORE', idx, top, '-inf', 'LIMIT', 0, 1) == 0 then return {out, ''} end
return {out, last}
"""

# ARGV: prefix, worker id, role, ttl (ms), now, field1, value1, ...
# Registers or refreshes a worker: its facts, their expiry and its heartbeat time. It tells the
# scheduler on the heartbeat channel only while requests are queued: a freed slot is news only
# to queued work (with none, every such message woke the scheduler for nothing).
# Replay: the same facts and time again; one more wake-up message at most.
HEARTBEAT = _LIB + """
local wk, now = key('worker', ARGV[2]), ARGV[5]
redis.call('HSET', wk, 'heartbeat_ms', now, unpack(ARGV, 6))
redis.call('PEXPIRE', wk, ARGV[4])
redis.call('ZADD', key('workers', ARGV[3]), now, ARGV[2])
if num(redis.call('HGET', key('load'), 'n'), 0) > 0 then
  redis.call('PUBLISH', key('heartbeats'), ARGV[2])
end
"""

# ARGV: prefix, cutoff (ms), role1, role2, ...
# The registry in one round trip: per role, the workers that heartbeat at or after the cutoff,
# each with its hash (empty once it expired) and its hand-off record {until, reason, streak}
# (see HANDOFFS); then the ids an operator drained.
# -> {{{id, {field, value, ...}, {until, reason, streak}}, ...} per role..., {drained ids}}
# Replay: read-only.
WORKERS = _LIB + """
local out = {}
for r = 3, #ARGV do
  local rows = {}
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', key('workers', ARGV[r]), ARGV[2], '+inf')) do
    local q = redis.call('HMGET', key('health', id), 'until', 'reason', 'streak')
    rows[#rows + 1] = {id, redis.call('HGETALL', key('worker', id)), {q[1] or '0', q[2] or '', q[3] or '0'}}
  end
  out[#out + 1] = rows
end
out[#out + 1] = redis.call('SMEMBERS', key('drained'))
return out
"""

# ARGV: prefix, event (this call's token: the batch id), ttl (ms), then per hand-off outcome:
#       worker id, the other side's worker id, ok (1 | 0)
# Counts KV hand-offs per worker, in order: a failure adds one to the worker's streak and the
# other side to its peers; a success ends the streak. -> per worker, in first-seen order,
# {id, streak, distinct peers in the streak, quarantines so far, quarantined until (ms)}
# Replay: each worker's record names this call's event: it is not counted again.
HANDOFFS = _LIB + """
local seen, order = {}, {}
for i = 4, #ARGV, 3 do
  local w, peer, ok = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local hk = key('health', w)
  if seen[w] == nil then
    seen[w] = redis.call('HGET', hk, 'event') ~= ARGV[2]
    order[#order + 1] = w
    if seen[w] then redis.call('HSET', hk, 'event', ARGV[2]) end
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
    if redis.call('PTTL', hk) < tonumber(ARGV[3]) then redis.call('PEXPIRE', hk, ARGV[3]) end
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
"""

# ARGV: prefix, worker id, until (ms), reason, quarantines so far (as read), now, ttl (ms)
# Quarantines a worker until `until` (no new work while others can take it), if its count of
# quarantines is still the one read (another scheduler may have done it meanwhile): ends its
# streak and counts one more quarantine. The record expires ttl after the quarantine ends.
# -> 1 when quarantined, 0 when the count had moved on
# Replay: the count moved on with the first run: 0, nothing written.
QUARANTINE = _LIB + """
local hk = key('health', ARGV[2])
if num(redis.call('HGET', hk, 'times'), 0) ~= tonumber(ARGV[5]) then return 0 end
redis.call('HSET', hk, 'until', ARGV[3], 'reason', ARGV[4], 'times', tonumber(ARGV[5]) + 1, 'streak', 0, 'peers', '')
redis.call('PEXPIRE', hk, math.max(0, tonumber(ARGV[3]) - tonumber(ARGV[6])) + tonumber(ARGV[7]))
return 1
"""

SCRIPTS = {"submit": SUBMIT, "claim": CLAIM, "requeue": REQUEUE, "transition": TRANSITION,
           "step": STEP, "finish": FINISH, "expire_deadlines": EXPIRE_DEADLINES,
           "reap_worker": REAP_WORKER, "expire_leases": EXPIRE_LEASES, "snapshot": SNAPSHOT,
           "cancel_tenant": CANCEL_TENANT, "set_deadline": SET_DEADLINE,
           "list_requests": LIST_REQUESTS, "heartbeat": HEARTBEAT, "workers": WORKERS,
           "handoffs": HANDOFFS, "quarantine": QUARANTINE}
