"""Every Redis key of pdq, and its Lua scripts (pdq/lua/*.lua, loaded here by name), in one place.

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
  p:leader                string "{epoch} {scheduler id}": the dispatch lease (scheduler.leader); expires
                                 leader_lease_s after its holder's last renewal
  p:leader:epoch          int    the latest leader epoch: a leader's claims and sweeps carry theirs, and
                                 a script refuses one that is not the latest ('FENCED')
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
  p:queued                pubsub channel: ids of requests put back in the queue (a requeue) or queued by a
                          standby scheduler's submit, or ""
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

Every script is safe to run twice in a row with the same arguments: a client of `pdq.state.redisconn`
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

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdq.state.request import TERMINAL


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
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def leader_epoch(self) -> str:
        return f"{self.prefix}:leader:epoch"

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


# The scripts, one file each in pdq/state/lua/, loaded by name. Each names its arguments on its
# first line, `-- ARGS: name ... [| what follows]`: a script reads them as `A.name` (a prelude
# binds them to ARGV in that order, after the key prefix) and the tail, if any, from
# ARGV[TAIL] on; the store passes them by name (`pack`). Each runs with lib.lua (key names
# mirroring Keys, the queue, fair-share counters, leases, the one way a request ends) before
# it, and before that the terminal states, generated from `pdq.state.request.State`
# (tests/test_keys_states.py checks every state name the scripts use).
_LUA = Path(__file__).resolve().parent / "lua"
_LIB = ("local TERMINAL = {" + ", ".join(f"{s.value}=true" for s in sorted(TERMINAL)) + "}\n"
        + (_LUA / "lib.lua").read_text())
SCRIPT_NAMES = ("submit", "claim", "requeue", "transition", "step", "finish", "expire_deadlines", "reap_worker",
                "expire_leases", "snapshot", "cancel_tenant", "set_deadline", "list_requests", "heartbeat",
                "workers", "handoffs", "quarantine", "lead", "resign")


@dataclass(frozen=True)
class ScriptArgs:
    """A script's named arguments, in wire order, and whether a tail of values follows them."""

    names: tuple[str, ...]
    tail: bool

    @classmethod
    def of(cls, source: str) -> "ScriptArgs":
        first = source.split("\n", 1)[0]
        if not first.startswith("-- ARGS: "):
            raise ValueError(f"a script's first line names its arguments (-- ARGS: ...), got {first!r}")
        names, bar, _ = first[len("-- ARGS: "):].partition("|")
        return cls(tuple(names.split()), bool(bar))

    def prelude(self) -> str:
        binds = ", ".join(f"{n} = ARGV[{i}]" for i, n in enumerate(self.names, start=2))
        return f"local A = {{{binds}}}\nlocal TAIL = {len(self.names) + 2}\n"


_SOURCES = {name: (_LUA / f"{name}.lua").read_text() for name in SCRIPT_NAMES}
ARGS = {name: ScriptArgs.of(src) for name, src in _SOURCES.items()}
SCRIPTS = {name: _LIB + ARGS[name].prelude() + src for name, src in _SOURCES.items()}


def pack(name: str, named: dict, tail: Sequence = ()) -> list:
    """The arguments of script `name` in wire order (after the key prefix): its named ones, every
    one given and no other, then the tail. TypeError names what is missing or unknown."""
    spec = ARGS[name]
    if set(named) != set(spec.names):
        missing, unknown = sorted(set(spec.names) - set(named)), sorted(set(named) - set(spec.names))
        raise TypeError(f"script {name}: missing {missing}, unknown {unknown}")
    if tail and not spec.tail:
        raise TypeError(f"script {name} takes no values after its named ones")
    return [named[n] for n in spec.names] + list(tail)
