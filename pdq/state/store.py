"""The request store: typed calls to the Lua scripts (`pdq/state/lua/`, loaded by `pdq.state.keys`).

`RequestStore` writes each operation once, as the `Call` it sends (`pdq.state.calls`); two stores
run them: `AsyncStore` on a `redis.asyncio.Redis`, the services' (gateway, scheduler, a worker's
RPC and heartbeat side), whose methods are `async def`; and `SyncStore` on a `redis.Redis`, the
writer of a worker's model thread (and of tools and tests), whose methods return their result.
Clients must use `decode_responses=False` (records hold protobuf bytes).
Every write is safe to repeat (a `pdq.state.redisconn` client re-sends a command whose reply was lost);
`pdq.state.keys` says why for each script. How a request ends, by every path: `pdq.state.ending`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields, replace
from collections.abc import Sequence
from typing import Any, Callable, Generic, NamedTuple, TypeVar

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pdq.state.ending import FAILURE, KINDS, LOST, Ending
from pdq.state.calls import AsyncRunner, Call, Command, Script, SyncRunner, command, op, pipeline, script
from pdq.state.keys import Keys, pack
from pdq.state.request import State
from pdq.v1 import internal_pb2 as pb

UNBOUNDED = 1 << 62


def now_ms() -> int:
    return int(time.time() * 1000)


class Deposed(Exception):
    """A leading scheduler's write was refused: another scheduler has been elected since
    (`scheduler.leader`); nothing was written."""


R = TypeVar("R")
T = TypeVar("T")


def _fenced(fn: Callable[[Any], R]) -> Callable[[Any], R]:
    """Parses a fenced script's answer: 'FENCED' raises Deposed, anything else goes to fn."""
    def parse(r: Any) -> R:
        if r in (b"FENCED", "FENCED"):
            raise Deposed("another scheduler leads now: this one's write was refused")
        return fn(r)
    return parse


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _record(raw: dict[Any, Any]) -> dict[str, Any]:
    """A request hash as {field: str}, with `spec` (protobuf bytes) left as bytes."""
    return {_str(f): (v if _str(f) == "spec" else _str(v)) for f, v in raw.items()}


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a worker step: maybe a token, maybe its end."""

    request_id: str
    epoch: int
    index: int | None = None  # token index in the completion; None = no token this step
    token_id: int = 0
    text: str = ""
    final_state: State | None = None
    finish_reason: str = ""
    logprobs: str = ""  # the token's log-probabilities (`encode_logprobs`), when its request asked


@dataclass(frozen=True)
class Moved:
    """A state transition that happened (truthy), with the request's deadline as its record has it
    now (Unix ms, 0 = none): an operator may have moved it after the spec a worker holds was
    written, and a worker can miss that notice (its listener was reconnecting)."""

    deadline_ms: int


def _moved(reply: Any) -> "Moved | bool":
    return Moved(int(reply[1])) if isinstance(reply, list) and reply and int(reply[0]) else False


@dataclass(frozen=True)
class QueueLimits:
    """Admission bounds on queued work; tokens of a request = prompt + max_tokens."""

    max_queued: int = UNBOUNDED
    max_queued_tokens: int = UNBOUNDED
    tenant_max_queued: int = UNBOUNDED
    tenant_max_queued_tokens: int = UNBOUNDED


@dataclass(frozen=True)
class RetryLimits:
    """How given-back attempts are retried (besides max_attempts, which callers pass): at most
    `max_lost` attempts lost to infrastructure, and after the n-th failure a request waits
    backoff_ms * 2**(n-1) (at most backoff_max_ms) before it is dispatched again."""

    max_lost: int = 20
    backoff_ms: int = 500
    backoff_max_ms: int = 10_000

    @classmethod
    def of(cls, config: Any) -> "RetryLimits":
        """From a `pdq.config.StoreConfig` (its max_lost_attempts, retry_backoff_ms, retry_backoff_max_ms)."""
        return cls(config.max_lost_attempts, config.retry_backoff_ms, config.retry_backoff_max_ms)


class SubmitArgs(NamedTuple):
    """One request for `RequestStore.submit_many`: `submit`'s arguments."""

    spec: pb.RequestSpec
    idempotency_key: str = ""
    limits: QueueLimits = QueueLimits()
    seq: int = 0
    score: float | None = None


@dataclass(frozen=True)
class Submitted:
    """What became of a submit: kind "created", "existing" (an idempotent retry; request_id is
    the first request's), "conflict" (the id names a request with other content; request_id is
    that request's) or "rejected" (reason names the bound; `drain_tokens` is how many queued
    tokens must leave before a retry can pass)."""

    kind: str
    request_id: str = ""
    reason: str = ""
    drain_tokens: int = 0
    replicas: int = -1  # replicas that confirmed the write (`submit_many` with replicas); -1: not asked


def _submitted(r: list[Any]) -> Submitted:
    kind = int(r[0])
    if kind == -1:
        return Submitted("rejected", reason=_str(r[1]), drain_tokens=int(r[2]))
    return Submitted({1: "created", 0: "existing", -2: "conflict"}[kind], _str(r[1]))


@dataclass(frozen=True)
class Claimed:
    """One claimed request: epoch 0 means it was no longer queued (cancelled, ended)."""

    request_id: str
    epoch: int
    spec: bytes | None


@dataclass(frozen=True)
class TenantPolicy:
    """A tenant's scheduling policy, kept in the `p:tenant:{name}` hash (written by operators);
    None means the scheduler's default. `tier` is the best tier the tenant may use."""

    weight: float | None = None
    tier: str | None = None
    max_queued: int | None = None
    max_queued_tokens: int | None = None

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> "TenantPolicy":
        """Reads the hash; a missing, malformed or non-positive number means the default."""
        h = {_str(k): _str(v) for k, v in raw.items()}
        return cls(weight=_positive(h.get("weight"), float), tier=h.get("tier") or None,
                   max_queued=_positive(h.get("max_queued"), int),
                   max_queued_tokens=_positive(h.get("max_queued_tokens"), int))


def _positive(text: str | None, kind: type) -> Any:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class QueuedHead:
    """A queued request as the dispatcher sees it in a snapshot; `avoid`: the workers of its
    failed attempts."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    created_ms: int
    deadline_ms: int
    avoid: frozenset[str] = frozenset()


class Snapshot(dict[str, list["TenantBacklog"]]):
    """{tier: [TenantBacklog]}, and `next_retry_ms`: the earliest time (Unix ms) a request held
    back after a failure may be dispatched (0 = none held back)."""

    next_retry_ms: int = 0


@dataclass(frozen=True)
class TenantBacklog:
    """One backlogged tenant of a tier in a snapshot: its VTC counter, weight (None = default)
    and the head of its queue in order."""

    tenant: str
    counter: float
    weight: float | None
    heads: list[QueuedHead]


@dataclass(frozen=True)
class StepArgs:
    """A step's arguments for the STEP script (`pdq.state.keys`): items grouped into runs, each run the
    consecutive tokens of one request (index i, i+1, ...) and maybe its end, so Redis checks
    each request once and gets 10 arguments for a run instead of 8 for every token. `runs`:
    items per run, to give each item its run's answer."""

    args: list[Any]
    runs: list[int]

    def kept(self, reply: list[Any]) -> list[bool]:
        """The script's answer per run -> True (kept) / False (drop) per item."""
        if len(reply) == len(self.runs) and all(reply):  # most steps: every run kept
            return [True] * sum(self.runs)
        out: list[bool] = []
        for n, ok in zip(self.runs, reply):
            out += [bool(ok)] * n
        return out


def encode_logprobs(chosen: float, top: list[tuple[int, float]]) -> str:
    """One token's log-probabilities as its stream entry holds them: "LP ID:LP ID:LP ..." (the
    token's own, then the top tokens', most likely first). Records of a run join with ","."""
    return " ".join([f"{chosen:.7g}", *(f"{t}:{v:.7g}" for t, v in top)])


def decode_logprobs(record: str) -> tuple[float, list[tuple[int, float]]]:
    """`encode_logprobs`'s inverse."""
    head, *top = record.split(" ")
    return float(head), [(int(t), float(v)) for t, v in (x.split(":") for x in top)]


def _transition_args(rid: str, epoch: int, state: State, fields: dict[str, Any]) -> list[Any]:
    return pack("transition", {"id": rid, "epoch": epoch, "state": state.value},
                [x for name, value in fields.items() for x in (name, value)])


def _step_args(items: list[StepItem], result_ttl_s: int) -> StepArgs:
    args: list[Any] = []  # the runs, 10 values each (step.lua); `pack` puts now and ttl before them
    runs: list[int] = []
    i, n = 0, len(items)
    while i < n:
        first = items[i]
        j = i + 1
        if first.index is not None:
            while (j < n and items[j - 1].final_state is None and items[j].request_id == first.request_id
                   and items[j].epoch == first.epoch and items[j].index == first.index + (j - i)):
                j += 1
        run = items[i:j]
        last = run[-1]
        if first.index is None:
            args += [first.request_id, first.epoch, "", 0, "", "", ""]
        elif j == i + 1:  # one token (stream interval 1): no joins
            args += [first.request_id, first.epoch, first.index, 1, str(first.token_id), first.text,
                     len(first.text) if first.text.isascii() else len(first.text.encode())]
        else:
            args += [first.request_id, first.epoch, first.index, len(run),
                     ",".join(str(it.token_id) for it in run), "".join(it.text for it in run),
                     ",".join(str(len(it.text.encode())) for it in run)]
        args += [last.final_state.value if last.final_state else "", last.finish_reason,
                 (first.logprobs if j == i + 1 else ",".join(it.logprobs for it in run))
                 if first.index is not None and first.logprobs else ""]
        runs.append(len(run))
        i = j
    return StepArgs(pack("step", {"now": now_ms(), "ttl": result_ttl_s}, args), runs)


@dataclass(frozen=True)
class HandoffRecord:
    """A worker's KV hand-off record after HANDOFFS counted a batch: failed hand-offs in a row,
    how many distinct workers were on the other side of them, quarantines so far, and the end of
    its current or last quarantine (Unix ms, 0 = never)."""

    worker_id: str
    streak: int
    peers: int
    times: int
    until_ms: int


HEALTH_TTL_MS = 3600_000  # a worker's hand-off record lasts this long after its last change


def _pair(r: Any) -> tuple[int, int]:
    return int(r[0]), int(r[1])


def _first_score(reply: list[Any]) -> int | None:
    """A ZRANGE ... WITHSCORES reply's first score: [[member, score], ...] as redis-py reads it, or
    the flat [member, score, ...] of the wire."""
    if not reply:
        return None
    first = reply[0]
    return int(float(first[1] if isinstance(first, (list, tuple)) else reply[1]))


def _state(r: Any) -> State | None:
    return State(_str(r)) if r else None


Registry = tuple[dict[str, list[tuple[str, dict[str, str], tuple[int, str, int]]]], set[str]]


class RequestStore:
    """The operations on pdq's Redis state, each written once as the `Call` it sends (`@op`);
    run by an `AsyncStore` or a `SyncStore`."""

    keys: Keys

    def __init__(self, result_ttl_s: int = 3600, retry: RetryLimits = RetryLimits()):
        self.result_ttl_s = result_ttl_s
        self.retry = retry

    def _script(self, name: str, parse: Callable[[Any], R], tail: Sequence[Any] = (), **named: Any) -> Call[R]:
        """A call of script `name` with its arguments by name (its `-- ARGS:` line), then `tail`."""
        return script(name, pack(name, named, tail), parse)

    # -- the queue: the scheduler's calls --------------------------------------------------

    @op
    def submit(self, spec: pb.RequestSpec, idempotency_key: str = "", limits: QueueLimits = QueueLimits(),
               seq: int = 0, score: float | None = None) -> Call[Submitted]:
        """Writes and queues a request in its tier and tenant queue, unless a bound is reached.
        `score` orders it in its tenant's queue (default: `seq`, arrival order); seq 0 takes the
        next arrival number. The record keeps `spec.content_hash` and the client's request id
        (`spec.client_request_id`, else the idempotency key); a key or request id that names a
        request with another content hash is a "conflict". A replay of this call (its reply
        lost) answers as the first run did. -> Submitted."""
        return script("submit", self._submit_args(spec, idempotency_key, limits, seq, score), _submitted)

    @op
    def submit_many(self, items: list[SubmitArgs], replicas: int = 0, timeout_ms: int = 0) -> Call[list[Submitted]]:
        """`submit` of every item in one round trip, in order; with `replicas`, then one WAIT for
        them all, on the same connection (it answers once that many replicas have every write
        before it, or after `timeout_ms`). -> a Submitted per item, `replicas` the number of
        replicas that confirmed them."""
        parts: tuple[Script | Command, ...] = tuple(Script("submit", self._submit_args(*item)) for item in items)
        if not replicas:
            return Call(parts, lambda r: [_submitted(x) for x in r])
        return Call(parts + (("WAIT", replicas, timeout_ms),),
                    lambda r: [replace(_submitted(x), replicas=int(r[-1])) for x in r[:-1]])

    def _submit_args(self, spec: pb.RequestSpec, idempotency_key: str, limits: QueueLimits, seq: int,
                     score: float | None) -> list[Any]:
        return pack("submit", dict(
            id=spec.request_id, spec=spec.SerializeToString(), tenant=spec.tenant, tier=spec.tier,
            now=spec.arrival_ms, deadline_ms=spec.deadline_ms, prompt_tokens=len(spec.prompt_token_ids),
            max_tokens=spec.sampling.max_tokens, seq=seq, score="" if score is None else score, idem=idempotency_key,
            idem_ttl=self.result_ttl_s, max_queued=limits.max_queued, max_queued_tokens=limits.max_queued_tokens,
            tenant_max_queued=limits.tenant_max_queued, tenant_max_queued_tokens=limits.tenant_max_queued_tokens,
            token=uuid.uuid4().hex[:16], content_hash=spec.content_hash,
            client_request_id=spec.client_request_id or idempotency_key))

    @op
    def snapshot(self, tiers: list[str], max_tenants: int, max_heads: int) -> Call[Snapshot]:
        """A bounded view of the queue: per tier (in the order given), up to `max_tenants`
        backlogged tenants with the lowest counters, each with up to `max_heads` requests from
        the head of its queue, leaving out requests held back after a failure (until their
        retry_at). -> Snapshot"""
        def parse(raw: list[Any]) -> Snapshot:
            out = Snapshot()
            for tier, rows in zip(tiers, raw):
                backlogs = []
                for tenant, counter, weight, flat in rows:
                    heads = [QueuedHead(_str(flat[i]), int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                                        int(flat[i + 4]), frozenset(_str(flat[i + 5]).split()))
                             for i in range(0, len(flat), 6)]
                    backlogs.append(TenantBacklog(_str(tenant), float(counter), _positive(_str(weight), float), heads))
                out[tier] = backlogs
            out.next_retry_ms = int(raw[len(tiers)])
            return out
        return self._script("snapshot", parse, tiers, max_tenants=max_tenants, max_heads=max_heads, now=now_ms())

    @op
    def claim(self, placed: list[tuple[str, str]], worker_id: str, address: str = "", lease_ms: int = 60_000,
              default_weight: float = 1.0, token: str = "", fence: int = 0) -> Call[list[Claimed]]:
        """Moves queued requests to PREFILLING on prefill worker `worker_id` (at `address`), each
        leased to it and to its decode worker: `placed` is [(request id, decode worker id)].
        The prefill lease runs `lease_ms`. Charges each tenant's counter. `token` names this
        claim (the batch id; default: a fresh one): a replay of the call answers the same
        epochs and specs. `fence`: the leader epoch it is made under (0: unfenced); Deposed
        when another scheduler leads. -> [Claimed]"""
        now = now_ms()
        pairs = [x for rid, decode_id in placed for x in (rid, decode_id)]

        def parse(r: list[Any]) -> list[Claimed]:
            return [Claimed(rid, int(ep), spec or None) for (rid, _), (ep, spec) in zip(placed, r)]
        return self._script("claim", _fenced(parse), pairs, now=now, worker=worker_id, address=address,
                            lease_until=now + lease_ms, weight=default_weight, token=token or uuid.uuid4().hex[:16],
                            fence=fence)

    @op
    def expire_deadlines(self, limit: int = 256, fence: int = 0) -> Call[int]:
        """Ends (TIMED_OUT) live requests past their deadline. -> how many were due.
        `fence`: as for claim."""
        return self._script("expire_deadlines", _fenced(int), now=now_ms(), limit=limit, ttl=self.result_ttl_s,
                            fence=fence)

    @op
    def next_deadline_ms(self) -> Call[int | None]:
        """The earliest deadline (Unix ms) of a live request, or None."""
        return command("ZRANGE", self.keys.deadlines, 0, 0, "WITHSCORES", parse=_first_score)

    @op
    def reap_worker(self, worker_id: str, max_attempts: int, fence: int = 0) -> Call[tuple[int, int]]:
        """Gives back the attempts of a worker that stopped heartbeating: lost attempts (they
        count towards `retry.max_lost`, not max_attempts). `fence`: as for claim.
        -> (requeued, failed)"""
        return self._script("reap_worker", _fenced(_pair), worker=worker_id, now=now_ms(), max_attempts=max_attempts,
                            ttl=self.result_ttl_s, max_lost=self.retry.max_lost, fence=fence)

    @op
    def expire_leases(self, max_attempts: int, limit: int = 256, fence: int = 0) -> Call[tuple[int, int]]:
        """Gives back requests whose prefill lease expired: lost attempts. `fence`: as for
        claim. -> (requeued, failed)"""
        return self._script("expire_leases", _fenced(_pair), now=now_ms(), max_attempts=max_attempts,
                            ttl=self.result_ttl_s, limit=limit, max_lost=self.retry.max_lost, fence=fence)

    # -- who dispatches: the scheduler's lease (scheduler.leader) ----------------------------

    @op
    def lead(self, scheduler_id: str, lease_ms: int) -> Call[tuple[int, str]]:
        """Takes or renews the dispatch lease for `scheduler_id`, for `lease_ms`.
        -> (epoch it leads under, holder id); epoch 0 while another scheduler holds it."""
        return self._script("lead", lambda r: (int(r[0]), _str(r[1])), id=scheduler_id, lease=lease_ms)

    @op
    def resign(self, scheduler_id: str) -> Call[bool]:
        """Frees the dispatch lease if `scheduler_id` holds it. -> whether it did."""
        return self._script("resign", lambda r: bool(int(r)), id=scheduler_id)

    # -- workers: hand-off health and the registry -------------------------------------------

    @op
    def handoffs(self, event: str, outcomes: list[tuple[str, str, bool]]) -> Call[list[HandoffRecord]]:
        """Counts KV hand-off outcomes, in order: (worker id, the other side's id, ok) each, a
        hand-off counting for both of its workers (pass it once per side). `event` names the
        call (the batch id): a replay is not counted twice. -> [HandoffRecord] per worker."""
        args: list[Any] = []
        for worker, peer, ok in outcomes:
            args += [worker, peer, int(ok)]
        return self._script("handoffs", lambda r: [HandoffRecord(_str(w), int(s), int(p), int(t), int(u))
                                                   for w, s, p, t, u in r],
                            args, event=event, ttl=HEALTH_TTL_MS)

    @op
    def quarantine(self, worker_id: str, until_ms: int, reason: str, times: int) -> Call[bool]:
        """Quarantines a worker until `until_ms`, unless its quarantine count moved on from
        `times` (someone else did it). -> True when quarantined."""
        return self._script("quarantine", bool, worker=worker_id, until_ms=until_ms, reason=reason, times=times,
                            now=now_ms(), ttl=HEALTH_TTL_MS)

    @op
    def heartbeat(self, worker_id: str, role: str, ttl_ms: int, facts: dict[str, Any]) -> Call[None]:
        """Registers or refreshes a worker's registry entry (`facts`: its hash fields), expiring
        after ttl_ms; tells the scheduler on the heartbeat channel while requests are queued."""
        args: list[Any] = []
        for name, value in facts.items():
            args += [name, value]
        return self._script("heartbeat", lambda r: None, args, worker=worker_id, role=role, ttl=ttl_ms, now=now_ms())

    @op
    def workers(self, roles: tuple[str, ...], cutoff_ms: int) -> Call[Registry]:
        """The registry in one round trip: the workers of each role that heartbeat at or after
        cutoff_ms, each with its hash and its quarantine (until ms, reason) and hand-off failure
        streak, and the ids an operator drained.
        -> ({role: [(worker id, {field: value}, (until ms, reason, streak))]}, {drained ids})"""
        def parse(raw: list[Any]) -> Registry:
            out = {}
            for role, rows in zip(roles, raw):
                out[role] = [(_str(wid), {_str(flat[i]): _str(flat[i + 1]) for i in range(0, len(flat), 2)},
                              (int(q[0]), _str(q[1]), int(q[2])))
                             for wid, flat, q in rows]
            return out, {_str(d) for d in raw[len(roles)]}
        return self._script("workers", parse, roles, cutoff=cutoff_ms)

    # -- queue state and tenants: the operator's calls ----------------------------------------

    @op
    def load(self) -> Call[dict[str, int]]:
        """Queued work: {"n": requests, "tokens": tokens, "n:{tenant}": ..., "tokens:{tenant}": ...},
        and "running", "running:{tenant}": requests claimed and not ended."""
        return command("HGETALL", self.keys.load, parse=lambda raw: {_str(k): int(v) for k, v in raw.items()})

    @op
    def tenant_policy(self, tenant: str) -> Call[TenantPolicy]:
        return command("HGETALL", self.keys.tenant(tenant), parse=TenantPolicy.from_hash)

    @op
    def policy_and_seq(self, tenant: str) -> Call[tuple[TenantPolicy, int]]:
        """The tenant's policy and the next arrival number (for an order score computed before
        submit), in one round trip (a replay skips an arrival number: harmless, the numbers only
        order). -> (TenantPolicy, seq)"""
        return pipeline([("HGETALL", self.keys.tenant(tenant)), ("INCR", self.keys.seq)],
                        lambda r: (TenantPolicy.from_hash(r[0]), int(r[1])))

    @op
    def set_tenant_policy(self, tenant: str, policy: TenantPolicy) -> Call[None]:
        """Writes a tenant's policy; None fields are removed (back to the default)."""
        key = self.keys.tenant(tenant)
        cmds: list[Command] = []
        for f in fields(policy):
            value = getattr(policy, f.name)
            cmds.append(("HDEL", key, f.name) if value is None else ("HSET", key, f.name, value))
        if any(getattr(policy, f.name) is not None for f in fields(policy)):
            cmds.append(("SADD", self.keys.tenants, tenant))
        else:
            cmds.append(("SREM", self.keys.tenants, tenant))
        return pipeline(cmds, lambda r: None, transaction=True)

    @op
    def tenants(self) -> Call[list[str]]:
        """Names of the tenants with a policy, sorted."""
        return command("SMEMBERS", self.keys.tenants, parse=lambda r: sorted(_str(t) for t in r))

    @op
    def depth(self, tiers: list[str]) -> Call[list[tuple[str, str, int, int]]]:
        """Queued work per tier and tenant: [(tier, tenant, requests, tokens)]."""
        def parse(raw: list[Any]) -> list[tuple[str, str, int, int]]:
            out = []
            for tier, h in zip(tiers, raw):
                h = {_str(k): int(v) for k, v in h.items()}
                out += [(tier, f[2:], n, h.get("tokens:" + f[2:], 0)) for f, n in sorted(h.items()) if f.startswith("n:")]
            return out
        return pipeline([("HGETALL", self.keys.depth(tier)) for tier in tiers], parse)

    @op
    def pause(self, tier: str = "", tenant: str = "", paused: bool = True) -> Call[int]:
        """Stops (or with paused=False resumes) dispatching a tier's or a tenant's queued
        requests. -> how many of the names given changed."""
        members = ([f"tier:{tier}"] if tier else []) + ([f"tenant:{tenant}"] if tenant else [])
        if not members:
            raise ValueError("pause needs a tier or a tenant")
        if paused:
            return command("SADD", self.keys.paused, *members, parse=int)
        # resumed: wake a scheduler whose queue looked empty
        return pipeline([("SREM", self.keys.paused, *members), ("PUBLISH", self.keys.queued_channel, "")],
                        lambda replies: int(replies[0]), transaction=True)

    @op
    def announce(self, request_id: str) -> Call[int]:
        """Tells the leading scheduler that `request_id` was queued by another one (a standby's
        submit): the queued channel wakes its dispatch loop."""
        return command("PUBLISH", self.keys.queued_channel, request_id, parse=int)

    @op
    def paused(self) -> Call[tuple[list[str], list[str]]]:
        """-> (paused tiers, paused tenants), sorted."""
        def parse(raw: set[Any]) -> tuple[list[str], list[str]]:
            names = sorted(_str(m) for m in raw)
            return ([n[5:] for n in names if n.startswith("tier:")], [n[7:] for n in names if n.startswith("tenant:")])
        return command("SMEMBERS", self.keys.paused, parse=parse)

    @op
    def end_tenant(self, tenant: str, ending: Ending) -> Call[int]:
        """Ends every live request of a tenant, in any state (a cancel: `Ending.cancelled`).
        -> how many"""
        if ending.state != State.CANCELLED:
            raise ValueError("a tenant's requests end only CANCELLED")
        return self._script("cancel_tenant", int, tenant=tenant, reason=ending.error, now=now_ms(),
                            ttl=self.result_ttl_s)

    @op
    def set_deadline(self, rid: str, deadline_ms: int) -> Call[State | None]:
        """Moves a live request's absolute deadline: the scheduler's janitor enforces it, workers
        running the request hear of it on the deadline channel. -> state, None if unknown"""
        return self._script("set_deadline", _state, id=rid, deadline=deadline_ms)

    @op
    def list_requests(self, tenant: str = "", state: str = "", tier: str = "", limit: int = 100,
                      cursor: str = "", max_scan: int = 5000) -> Call[tuple[list[str], str]]:
        """Request ids newest first (by arrival), filtered by tenant, state and tier, looking at
        no more than `max_scan` index entries (so a page may be short). `cursor` is a previous
        call's next cursor. -> (ids, next cursor; "" when there is no more)"""
        return self._script("list_requests", lambda r: ([_str(i) for i in r[0]], _str(r[1])), tenant=tenant,
                            state=state, tier=tier, limit=limit, cursor=cursor, scan=max_scan)

    @op
    def records(self, rids: list[str]) -> Call[list[dict[str, Any]]]:
        """The records of several requests (see `record`), in order; {} for unknown ids."""
        return pipeline([("HGETALL", self.keys.request(rid)) for rid in rids], lambda raws: [_record(r) for r in raws])

    @op
    def prompts(self, rids: list[str]) -> Call[list[tuple[int, ...]]]:
        """The prompt token ids of several requests, in order, in one round trip; () for an
        unknown id (read-only: the scheduler places a request by them before it claims it)."""
        return pipeline([("HGET", self.keys.request(rid), "spec") for rid in rids],
                        lambda raws: [tuple(spec_from_bytes(raw).prompt_token_ids) if raw else () for raw in raws])

    # -- a request's life: the workers' and the gateway's calls ----------------------------

    @op
    def requeue(self, rid: str, epoch: int, error: str, max_attempts: int, kind: str = FAILURE) -> Call[str | None]:
        """Gives back attempt `epoch` of a request: back in the queue, or FAILED when its bound
        is reached. kind FAILURE (the request's own: counts towards max_attempts, the attempt's
        workers are avoided next time, after a backoff), LOST (infrastructure: counts towards
        retry.max_lost) or PREEMPTED (made room for a better tier: counts nothing). -> new state name, or None when the epoch is stale or it ended."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        r = self.retry
        return self._script("requeue", lambda x: _str(x) if x else None, id=rid, epoch=epoch, now=now_ms(),
                            max_attempts=max_attempts, error=error, ttl=self.result_ttl_s, kind=kind,
                            max_lost=r.max_lost, backoff_ms=r.backoff_ms, backoff_max_ms=r.backoff_max_ms)

    @op
    def transition(self, rid: str, epoch: int, state: State, /, **fields: Any) -> Call[Moved | bool]:
        """Moves a live request of this epoch to `state`, setting fields. -> Moved, or False
        when the epoch is stale or the request ended."""
        return script("transition", _transition_args(rid, epoch, state, fields), _moved)

    @op
    def step(self, items: list[StepItem]) -> Call[list[bool]]:
        """Appends tokens / ends requests in one round trip. -> per item True (kept) / False (drop)."""
        step = _step_args(items, self.result_ttl_s)
        return script("step", step.args, step.kept)

    @op
    def step_and_transition(self, items: list[StepItem], moves: list[tuple[str, int, State, dict[str, Any]]]
                            ) -> Call[tuple[list[bool], list[Moved | bool]]]:
        """`step(items)`, then `transition(rid, epoch, state, **fields)` of each move, applied in
        that order in one round trip: a colocated prefill's first tokens and the DECODING moves
        of the prompts its decode side takes. -> (step's kept, per move whether it moved). A
        script this Redis had not seen was not applied; it runs again (loading it), after those
        before it."""
        step = _step_args(items, self.result_ttl_s)
        parts = [Script("step", step.args)]
        parts += [Script("transition", _transition_args(rid, epoch, state, extra)) for rid, epoch, state, extra in moves]
        return Call(tuple(parts), lambda replies: (step.kept(replies[0]), [_moved(r) for r in replies[1:]]))

    @op
    def end(self, rid: str, ending: Ending, epoch: int | None = None) -> Call[State | None]:
        """Ends a request from outside its worker's step: the one call of every such path (see
        `pdq.state.ending`). With `epoch`, only while that attempt is the current one (a worker ending
        its own attempt). Ends it once: a request that has ended keeps its state.
        -> the state after, None if unknown."""
        return self._script("finish", _state, id=rid, state=ending.state.value, reason=ending.reason,
                            error=ending.error, now=now_ms(), ttl=self.result_ttl_s,
                            epoch="" if epoch is None else epoch)

    @op
    def record(self, rid: str) -> Call[dict[str, Any]]:
        """The request record as {field: str}, with `spec` left as bytes; {} when unknown."""
        return command("HGETALL", self.keys.request(rid), parse=_record)

    @op
    def states(self, rids: list[str]) -> Call[list[State | None]]:
        """The states of several requests, in order, in one round trip (None: unknown)."""
        return pipeline([("HGET", self.keys.request(rid), "state") for rid in rids],
                        lambda raw: [State(_str(v)) if v else None for v in raw])

    @op
    def deadlines(self, rids: list[str]) -> Call[list[int]]:
        """The deadlines (Unix ms, 0 = none or unknown) the records of `rids` hold now, in one
        round trip. A worker checks them before it times a request out: an operator may have
        moved one and the worker missed the notice."""
        return pipeline([("HGET", self.keys.request(rid), "deadline_ms") for rid in rids],
                        lambda raw: [int(v or 0) for v in raw])

    @op
    def record_fields(self, rid: str, names: tuple[str, ...]) -> Call[dict[str, str]]:
        """Some fields of the request record as {field: str}, those it has (no `spec` bytes)."""
        return command("HMGET", self.keys.request(rid), *names,
                       parse=lambda values: {n: _str(v) for n, v in zip(names, values) if v is not None})

    @op
    def streamed_tokens(self, rid: str) -> Call[list[int]]:
        """Token ids already written to the output stream, in index order."""
        return command("XRANGE", self.keys.output(rid), "-", "+",
                       parse=lambda entries: [int(t) for _, f in entries if b"i" in f for t in f[b"t"].split(b",")])

    @op
    def lookup_idempotent(self, tenant: str, key: str) -> Call[str | None]:
        """The request an idempotency key names for this tenant, None when none."""
        return command("GET", self.keys.idempotency(tenant, key), parse=lambda r: _str(r) if r else None)


class AsyncStore(RequestStore, AsyncRunner):
    """The services' store (gateway, scheduler, a worker's RPC and heartbeat side), on a
    `redis.asyncio.Redis`: each `RequestStore` operation is a coroutine."""

    def __init__(self, client: Any, prefix: str = "pdq", result_ttl_s: int = 3600,
                 retry: RetryLimits = RetryLimits()):
        if not isinstance(client, aioredis.Redis):
            raise TypeError(f"an AsyncStore needs a redis.asyncio.Redis client, got {type(client).__name__}")
        RequestStore.__init__(self, result_ttl_s, retry)
        AsyncRunner.__init__(self, client, prefix)


class SyncStore(RequestStore, SyncRunner):
    """A worker model thread's writer (and tools' and tests' store), on a `redis.Redis`: each
    `RequestStore` operation returns its result; `send` sends a call and reads its reply later."""

    def __init__(self, client: Any, prefix: str = "pdq", result_ttl_s: int = 3600,
                 retry: RetryLimits = RetryLimits()):
        if isinstance(client, aioredis.Redis):
            raise TypeError("a SyncStore needs a redis.Redis client, got a redis.asyncio one (use AsyncStore)")
        RequestStore.__init__(self, result_ttl_s, retry)
        SyncRunner.__init__(self, client, prefix)

    def send(self, call: Call[T]) -> "Sent[T]":
        """A call in two halves: its commands go out now, on a connection of their own, and
        `Sent.result()` reads the replies later. A model loop sends a step's tokens and reads
        the reply after its next forward pass, so Redis applies them meanwhile instead of the
        model waiting for the round trip. Until the reply is read, a command sent on another
        connection may be applied before it: a caller that needs the call applied first (a
        requeue) reads the reply first."""
        return Sent(self, call)


class Sent(Generic[T]):
    """A call sent by `SyncStore.send` whose replies are not read yet. `result()` reads them
    once: -> the call's result; raises what the call would have raised. A script this Redis
    had not seen was not applied: it runs again alone (loading it), after the rest."""

    def __init__(self, store: SyncStore, call: Call[T]):
        if call.transaction:
            raise ValueError("a transaction is not sent in halves")
        self._store, self._call = store, call
        self._pool = store.client.connection_pool
        self._conn: Any = self._pool.get_connection()
        prefix, scripts = store.keys.prefix, store._scripts
        try:  # packed by hiredis in one call: redis-py's packer encodes each of the ~10 values per run in Python
            self._conn.send_packed_command([hiredis.pack_command(
                ("EVALSHA", scripts[part.name].sha, 0, prefix, *part.args) if isinstance(part, Script) else part)
                for part in call.parts])
        except BaseException:
            self._release(broken=True)
            raise

    def result(self) -> T:
        if self._conn is None:
            raise RuntimeError("a sent call's reply is read once")
        replies: list[Any] = []
        try:
            for _ in self._call.parts:
                try:
                    replies.append(self._conn.read_response())
                except ResponseError as exc:  # this part's error; the replies after it are still to read
                    replies.append(exc)
        except BaseException:
            self._release(broken=True)
            raise
        self._release()
        return self._store.parse_replies(self._call, replies)

    def _release(self, broken: bool = False) -> None:
        if broken:
            self._conn.disconnect()  # a reply may be in flight: never hand this socket out again
        self._pool.release(self._conn)
        self._conn = None


def spec_from_bytes(raw: bytes) -> pb.RequestSpec:
    spec = pb.RequestSpec()
    spec.ParseFromString(raw)
    return spec
