-- ARGS: id spec tenant tier now deadline_ms prompt_tokens max_tokens seq score idem idem_ttl max_queued max_queued_tokens tenant_max_queued tenant_max_queued_tokens token content_hash client_request_id
-- ARGV: prefix, id, spec, tenant, tier, now, deadline_ms, prompt_tokens, max_tokens, seq (0 = next),
-- score ('' = seq), idem key ('' = none), idem_ttl, max_queued, max_queued_tokens,
-- tenant_max_queued, tenant_max_queued_tokens, token (this call's), content_hash ('' = none),
-- client_request_id
-- Bounds count a scope's queued requests and tokens (prompt + max_tokens); a scope with nothing
-- queued always admits, so no single request is refused forever. An idempotency key (or request id)
-- that names a request with another content hash is a conflict: a different request under a reused id.
-- -> {1, id} created | {0, existing id} idempotent retry | {-1, reason, tokens to drain} rejected
-- | {-2, existing id} conflict
-- Replay: the record exists and carries this call's token, so the replay answers {1, id} again
-- (a client's retry comes with another token and gets {0, id}); nothing is written twice.
local id, tenant, tier = A.id, A.tenant, A.tier
local idem, token, hash = A.idem, A.token, A.content_hash
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
local cost = tonumber(A.prompt_tokens) + tonumber(A.max_tokens)
local l = redis.call('HMGET', key('load'), 'n:' .. tenant, 'tokens:' .. tenant, 'n', 'tokens')
local checks = {{'TENANT_QUEUE_FULL', 'TENANT_QUEUE_TOKENS_FULL', l[1], l[2], A.tenant_max_queued, A.tenant_max_queued_tokens},
                {'QUEUE_FULL', 'QUEUE_TOKENS_FULL', l[3], l[4], A.max_queued, A.max_queued_tokens}}
for _, c in ipairs(checks) do
  local n, tokens = num(c[3], 0), num(c[4], 0)
  if n > 0 then
    if n + 1 > tonumber(c[5]) then return {-1, c[1], math.ceil(tokens / n)} end
    if tokens + cost > tonumber(c[6]) then return {-1, c[2], tokens + cost - tonumber(c[6])} end
  end
end
local seq = tonumber(A.seq)
if seq == 0 then seq = redis.call('INCR', key('seq')) end
local score = A.score
if score == '' then score = seq end
local rec = {'id', id, 'spec', A.spec, 'tenant', tenant, 'tier', tier, 'state', 'QUEUED', 'epoch', 0, 'seq', seq,
  'score', score, 'created_ms', A.now, 'deadline_ms', A.deadline_ms, 'prompt_tokens', A.prompt_tokens, 'max_tokens', A.max_tokens,
  'cost', cost, 'n_out', 0, 'attempts', 0, 'submit', token}
if hash ~= '' then rec[#rec + 1] = 'content_hash'; rec[#rec + 1] = hash end
if A.client_request_id ~= '' then rec[#rec + 1] = 'client_request_id'; rec[#rec + 1] = A.client_request_id end
redis.call('HSET', key('req', id), unpack(rec))
enqueue(id, tier, tenant, score, cost)
redis.call('SADD', key('live', tenant), id)
redis.call('ZADD', key('index'), seq, id)
redis.call('ZADD', key('index', tenant), seq, id)
if tonumber(A.deadline_ms) > 0 then redis.call('ZADD', key('deadlines'), A.deadline_ms, id) end
if idem ~= '' then redis.call('SET', key('idem', tenant, idem), id, 'EX', A.idem_ttl) end
return {1, id}
