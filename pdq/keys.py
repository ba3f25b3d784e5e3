"""Every Redis key and Lua script of pdq, in one place.

Layout (prefix `p`, default "pdq"):
  p:req:{id}          hash   the request record (fields below); expires result_ttl_s after it ends
  p:req:{id}:out      stream its output: one entry per token {i, t, x}, then {done, r, e}
  p:idem:{tenant}:{k} string client idempotency key -> request id
  p:queue             zset   queued request ids, score = arrival sequence number
  p:deadlines         zset   non-terminal request ids with a deadline, score = deadline (ms)
  p:seq               int    arrival sequence counter
  p:workers:{role}    zset   worker id -> last heartbeat (ms)
  p:worker:{id}       hash   worker facts: role, address, free_slots, ...
  p:cancel            pubsub channel: ids of requests that just ended, for workers to drop

Record fields: id, spec (RequestSpec protobuf bytes), tenant, tier, state, epoch, seq,
created_ms, deadline_ms, prompt_tokens, max_tokens, n_out, dispatched_ms, first_token_ms,
finished_ms, finish_reason, error, prefill_worker, decode_worker, attempts.

Every multi-key change is one Lua script, so it is atomic. A write carrying a lease epoch
other than the record's current one is rejected (a stale worker cannot write).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "pdq"

    def request(self, rid: str) -> str:
        return f"{self.prefix}:req:{rid}"

    def output(self, rid: str) -> str:
        return f"{self.prefix}:req:{rid}:out"

    def idempotency(self, tenant: str, key: str) -> str:
        return f"{self.prefix}:idem:{tenant}:{key}"

    @property
    def queue(self) -> str:
        return f"{self.prefix}:queue"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}:deadlines"

    @property
    def seq(self) -> str:
        return f"{self.prefix}:seq"

    def workers(self, role: str) -> str:
        return f"{self.prefix}:workers:{role}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"


_TERMINAL = """
local TERMINAL = {COMPLETED=true, CANCELLED=true, TIMED_OUT=true, FAILED=true, REJECTED=true}
"""

# finish(rk, ok, queue, deadlines, state, reason, err, now, ttl, channel): records the one
# terminal state, closes the output stream, drops queue/deadline entries, sets expiry.
_FINISH_FN = _TERMINAL + """
local function finish(rk, ok, queue, deadlines, state, reason, err, now, ttl, channel)
  local id = redis.call('HGET', rk, 'id')
  redis.call('HSET', rk, 'state', state, 'finish_reason', reason, 'error', err, 'finished_ms', now)
  redis.call('XADD', ok, '*', 'done', state, 'r', reason, 'e', err)
  redis.call('ZREM', queue, id)
  redis.call('ZREM', deadlines, id)
  redis.call('EXPIRE', rk, ttl)
  redis.call('EXPIRE', ok, ttl)
  redis.call('PUBLISH', channel, id)
end
"""

# KEYS: req, idem, queue, deadlines, seq
# ARGV: id, spec, tenant, tier, now, deadline_ms, prompt_tokens, max_tokens, max_queued,
#       use_idem (0/1), idem_ttl
# -> {1, id} created | {0, existing id} idempotent retry | {-1, reason} rejected
SUBMIT = """
if ARGV[10] == '1' then
  local existing = redis.call('GET', KEYS[2])
  if existing then return {0, existing} end
end
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[9]) then return {-1, 'QUEUE_FULL'} end
local seq = redis.call('INCR', KEYS[5])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'spec', ARGV[2], 'tenant', ARGV[3], 'tier', ARGV[4],
  'state', 'QUEUED', 'epoch', 0, 'seq', seq, 'created_ms', ARGV[5], 'deadline_ms', ARGV[6],
  'prompt_tokens', ARGV[7], 'max_tokens', ARGV[8], 'n_out', 0, 'attempts', 0)
redis.call('ZADD', KEYS[3], seq, ARGV[1])
if tonumber(ARGV[6]) > 0 then redis.call('ZADD', KEYS[4], ARGV[6], ARGV[1]) end
if ARGV[10] == '1' then redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[11]) end
return {1, ARGV[1]}
"""

# KEYS: queue, req_1 .. req_n      ARGV: now, worker
# Moves each still-QUEUED request to PREFILLING under a new epoch.
# -> list of epochs, 0 where the request was no longer queued
CLAIM = """
local out = {}
for i = 2, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'state', 'id')
  if h[1] == 'QUEUED' then
    local ep = redis.call('HINCRBY', KEYS[i], 'epoch', 1)
    redis.call('HINCRBY', KEYS[i], 'attempts', 1)
    redis.call('HSET', KEYS[i], 'state', 'PREFILLING', 'dispatched_ms', ARGV[1], 'prefill_worker', ARGV[2])
    redis.call('ZREM', KEYS[1], h[2])
    out[#out + 1] = ep
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: req, out, queue, deadlines     ARGV: epoch, now, max_attempts, error, ttl, channel
# Puts a request whose attempt failed back in the queue at its old place, or FAILS it when
# its attempts are spent. -> new state, or false when the epoch is stale / state terminal.
REQUEUE = _FINISH_FN + """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'attempts', 'seq', 'id')
if not h[1] or TERMINAL[h[1]] or h[1] == 'QUEUED' or h[2] ~= ARGV[1] then return false end
if tonumber(h[3]) >= tonumber(ARGV[3]) then
  finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], 'FAILED', 'error', ARGV[4], ARGV[2], ARGV[5], ARGV[6])
  return 'FAILED'
end
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'error', ARGV[4])
redis.call('ZADD', KEYS[3], h[4], h[5])
return 'QUEUED'
"""

# KEYS: req     ARGV: epoch, state, field1, value1, ...
# -> 1 when moved, 0 when the epoch is stale or the request ended
TRANSITION = _TERMINAL + """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not h[1] or TERMINAL[h[1]] or h[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""

# KEYS: queue, deadlines, then per item: req, out
# ARGV: now, ttl, channel, then per item 6 values:
#       epoch, index ('' = no token), token_id, text, final state ('' = none), finish reason
# Appends each item's token at its index (a replayed index is ignored) and optionally ends
# the request. -> per item 1 (written) or 0 (stale epoch / already ended: drop the sequence)
STEP = _FINISH_FN + """
local res = {}
local n = (#KEYS - 2) / 2
for j = 0, n - 1 do
  local rk, ok = KEYS[3 + 2 * j], KEYS[4 + 2 * j]
  local a = 4 + 6 * j
  local h = redis.call('HMGET', rk, 'state', 'epoch', 'n_out')
  if not h[1] or TERMINAL[h[1]] or h[2] ~= ARGV[a] then
    res[j + 1] = 0
  else
    if ARGV[a + 1] ~= '' then
      local i = tonumber(ARGV[a + 1])
      local n_out = tonumber(h[3])
      if i == n_out then
        redis.call('XADD', ok, '*', 'i', i, 't', ARGV[a + 2], 'x', ARGV[a + 3])
        redis.call('HSET', rk, 'n_out', i + 1)
        if i == 0 then redis.call('HSET', rk, 'first_token_ms', ARGV[1]) end
      elseif i > n_out then
        return redis.error_reply('token index gap: ' .. i .. ' > ' .. n_out)
      end
    end
    if ARGV[a + 4] ~= '' then
      finish(rk, ok, KEYS[1], KEYS[2], ARGV[a + 4], ARGV[a + 5], '', ARGV[1], ARGV[2], ARGV[3])
    end
    res[j + 1] = 1
  end
end
return res
"""

# KEYS: req, out, queue, deadlines    ARGV: state, reason, error, now, ttl, channel, epoch ('' = any)
# Ends a request from outside its worker (cancel, timeout, failure).
# -> the state after the call; false when the request does not exist.
FINISH = _FINISH_FN + """
local h = redis.call('HMGET', KEYS[1], 'state', 'epoch')
if not h[1] then return false end
if TERMINAL[h[1]] then return h[1] end
if ARGV[7] ~= '' and ARGV[7] ~= h[2] then return h[1] end
finish(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return ARGV[1]
"""

SCRIPTS = {"submit": SUBMIT, "claim": CLAIM, "requeue": REQUEUE, "transition": TRANSITION,
           "step": STEP, "finish": FINISH}
