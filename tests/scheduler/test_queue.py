"""The queue in Redis (pdq.state.keys scripts on a real server): tier and tenant queues, fair-share
counters, admission bounds, cancellation and deadlines in every state, leases and reaping."""

import pytest

from pdq.state.ending import LOST, Ending
from pdq.state.request import State
from pdq.state.store import QueueLimits, SyncStore, RetryLimits, StepItem, TenantPolicy, now_ms
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb

T = "interactive"


def spec(rid, tenant="acme", tier=T, prompt=3, max_tokens=4, deadline_ms=0, created=1):
    return pb.RequestSpec(request_id=rid, tenant=tenant, tier=tier, prompt_token_ids=[5] * prompt,
                          sampling=gen_pb.SamplingParams(max_tokens=max_tokens, seed=1), arrival_ms=created,
                          deadline_ms=deadline_ms)


@pytest.fixture
def store(redis_client, prefix):
    return SyncStore(redis_client, prefix, result_ttl_s=60)


def queued(store, tenant="acme", tier=T):
    return [x.decode() for x in store.client.zrange(store.keys.queue(tier, tenant), 0, -1)]


def counter(store, tenant, tier=T):
    return float(store.client.hget(store.keys.vtc(tier), tenant) or 0)


def backlog(store, tier=T):
    return {k.decode(): v for k, v in store.client.zrange(store.keys.backlog(tier), 0, -1, withscores=True)}


def claim(store, *rids, prefill="p1", decode="d1"):
    return [c.epoch for c in store.claim([(r, decode) for r in rids], prefill, "host:1")]


def to_state(store, rid, state):
    """Drives a fresh request to `state` through the scripts the workers use."""
    store.submit(spec(rid))
    if state == State.QUEUED:
        return
    claim(store, rid)
    if state == State.PREFILLING:
        return
    assert store.step([StepItem(rid, 1, 0, 7, "a")]) == [True]
    assert store.transition(rid, 1, State.TRANSFERRING)
    if state == State.DECODING:
        assert store.transition(rid, 1, State.DECODING, decode_worker="host:2")


def clean(store, rid):
    """Nothing of the request is left in any queue, counter of queued work, lease or deadline."""
    k = store.keys
    assert not store.client.exists(k.queue(T, "acme"))
    assert not any(store.load().values())  # nothing queued, nothing running
    assert not store.client.zscore(k.leases, rid) and not store.client.zscore(k.deadlines, rid)
    assert not store.client.sismember(k.held("p1"), rid) and not store.client.sismember(k.held("d1"), rid)


# -- queue structure ------------------------------------------------------------------------------

def test_submit_puts_each_request_in_its_tier_and_tenant_queue(store):
    store.submit(spec("a1", "a"))
    store.submit(spec("b1", "b", tier="batch"))
    store.submit(spec("a2", "a"))
    assert queued(store, "a") == ["a1", "a2"] and queued(store, "b", "batch") == ["b1"]
    assert set(backlog(store)) == {"a"} and set(backlog(store, "batch")) == {"b"}
    assert store.load() == {"n": 3, "tokens": 21, "n:a": 2, "tokens:a": 14, "n:b": 1, "tokens:b": 7}
    assert store.record("a1")["cost"] == "7"


def test_score_orders_a_tenants_queue_and_survives_a_requeue(store):
    store.submit(spec("long"), score=500)
    store.submit(spec("short"), score=10)
    assert queued(store) == ["short", "long"]
    claim(store, "short")
    store.requeue("short", 1, "worker died", 3)
    assert queued(store) == ["short", "long"]


def test_snapshot_lists_backlogged_tenants_by_counter_with_their_heads(store):
    store.set_tenant_policy("b", TenantPolicy(weight=2.0))
    for k in range(3):
        store.submit(spec(f"a{k}", "a", created=100 + k))
    store.submit(spec("b0", "b", prompt=8, deadline_ms=10**13, created=50))
    claim(store, "a0")  # a is charged 7
    snap = store.snapshot([T, "batch"], 10, 10)
    assert snap["batch"] == []
    b, a = snap[T]
    assert (b.tenant, b.counter, b.weight, [h.request_id for h in b.heads]) == ("b", 0.0, 2.0, ["b0"])
    assert (b.heads[0].prompt_tokens, b.heads[0].max_tokens, b.heads[0].created_ms) == (8, 4, 50)
    assert (a.tenant, a.counter, a.weight, [h.request_id for h in a.heads]) == ("a", 7.0, None, ["a1", "a2"])
    assert [t.tenant for t in store.snapshot([T], 1, 1)[T]] == ["b"]
    assert [h.request_id for h in store.snapshot([T], 10, 1)[T][1].heads] == ["a1"]


# -- fair-share counters ------------------------------------------------------------------------

def test_a_request_is_charged_once_by_its_weight_and_settled_by_its_output(store):
    store.set_tenant_policy("acme", TenantPolicy(weight=2.0))
    store.submit(spec("r", prompt=6, max_tokens=10))
    claim(store, "r")
    assert counter(store, "acme") == 8.0  # (6 + 10) / 2
    store.requeue("r", 1, "worker died", 3)
    claim(store, "r")  # a retry is not charged again
    assert counter(store, "acme") == 8.0
    store.step([StepItem("r", 3, i, 7, "x") for i in range(4)])
    store.step([StepItem("r", 3, final_state=State.COMPLETED, finish_reason="eos")])
    assert counter(store, "acme") == 5.0  # (6 + 4 produced) / 2


def test_a_cancelled_queued_request_costs_nothing(store):
    store.submit(spec("r"))
    store.end("r", Ending(State.CANCELLED, "cancelled"))
    assert counter(store, "acme") == 0.0


def test_a_tenant_back_from_idle_is_lifted_to_the_lowest_backlogged_counter(store):
    store.client.hset(store.keys.vtc(T), mapping={"idle": 5, "busy": 100, "busier": 300})
    store.submit(spec("b1", "busy"))
    store.submit(spec("c1", "busier"))
    assert backlog(store) == {"busy": 100.0, "busier": 300.0}
    store.submit(spec("i1", "idle"))
    assert counter(store, "idle") == 100.0 and backlog(store)["idle"] == 100.0
    store.client.hset(store.keys.vtc(T), "rich", 1000)
    store.submit(spec("r1", "rich"))
    assert counter(store, "rich") == 1000.0  # never lowered


def test_with_nobody_backlogged_a_returning_tenant_is_lifted_to_the_last_one_served(store):
    store.submit(spec("b1", "busy", prompt=50, max_tokens=50))
    claim(store, "b1")  # busy is charged 100 and leaves the backlog: the floor is 100
    assert backlog(store) == {} and counter(store, "busy") == 100.0
    store.submit(spec("n1", "newcomer"))
    assert counter(store, "newcomer") == 100.0


def test_claim_keeps_backlog_scores_equal_to_counters(store):
    for k in range(3):
        store.submit(spec(f"a{k}", "a"))
    store.submit(spec("b0", "b"))
    claim(store, "a0", "a1")
    assert backlog(store) == {"a": 14.0, "b": 0.0} and counter(store, "a") == 14.0


# -- admission --------------------------------------------------------------------------------------

@pytest.mark.parametrize("limits, reason, drain", [
    (QueueLimits(tenant_max_queued=2), "TENANT_QUEUE_FULL", 7),
    (QueueLimits(tenant_max_queued_tokens=20), "TENANT_QUEUE_TOKENS_FULL", 1),
    (QueueLimits(max_queued=3), "QUEUE_FULL", 7),
    (QueueLimits(max_queued_tokens=25), "QUEUE_TOKENS_FULL", 3),
])
def test_bounds_on_queued_requests_and_tokens_overall_and_per_tenant(store, limits, reason, drain):
    store.submit(spec("a1", "a"))
    store.submit(spec("a2", "a"))
    store.submit(spec("b1", "b"), limits=limits)  # b has nothing queued: only the overall bounds apply
    got = store.submit(spec("a3", "a"), limits=limits)
    assert (got.kind, got.reason, got.drain_tokens) == ("rejected", reason, drain)
    assert store.record("a3") == {} and queued(store, "a") == ["a1", "a2"]


def test_a_scope_with_nothing_queued_admits_even_a_request_over_the_token_bound(store):
    assert store.submit(spec("huge", prompt=500), limits=QueueLimits(max_queued_tokens=100)).kind == "created"


def test_an_idempotent_retry_is_answered_even_when_the_queue_is_full(store):
    store.submit(spec("r1"), "key-1")
    got = store.submit(spec("r2"), "key-1", limits=QueueLimits(max_queued=1))
    assert (got.kind, got.request_id) == ("existing", "r1")


def test_queued_work_is_counted_out_as_requests_leave_the_queue(store):
    for k in range(3):
        store.submit(spec(f"r{k}"))
    claim(store, "r0")
    store.end("r1", Ending(State.CANCELLED, "cancelled"))
    assert store.load() == {"n": 1, "tokens": 7, "n:acme": 1, "tokens:acme": 7, "running": 1, "running:acme": 1}
    assert store.depth([T, "batch"]) == [(T, "acme", 1, 7)]
    store.requeue("r0", 1, "worker died", 3)
    assert store.load()["n"] == 2 and store.load()["running"] == 0


# -- cancellation and deadlines, in every state ---------------------------------------------------

LIVE = [State.QUEUED, State.PREFILLING, State.TRANSFERRING, State.DECODING]


@pytest.mark.parametrize("state", LIVE)
def test_cancel_in_any_state_ends_once_and_frees_everything(store, state):
    to_state(store, "r", state)
    assert store.record("r")["state"] == state.value
    assert store.end("r", Ending(State.CANCELLED, "cancelled", "by client")) == State.CANCELLED
    assert store.end("r", Ending(State.CANCELLED, "cancelled")) == State.CANCELLED  # idempotent
    clean(store, "r")
    assert store.step([StepItem("r", 1, 1, 8, "b")]) == [False]  # its worker drops it at the next step
    assert store.transition("r", 1, State.DECODING) is False
    assert store.requeue("r", 1, "late", 3) is None
    assert claim(store, "r") == [0]
    ends = [f for _, f in store.client.xrange(store.keys.output("r")) if b"done" in f]
    assert [f[b"done"] for f in ends] == [b"CANCELLED"]


@pytest.mark.parametrize("state", LIVE)
def test_deadline_expiry_times_out_live_requests_in_any_state(store, state):
    to_state(store, "r", state)
    store.client.hset(store.keys.request("r"), "deadline_ms", 1)
    store.client.zadd(store.keys.deadlines, {"r": 1})
    store.submit(spec("later", deadline_ms=now_ms() + 60_000))
    assert store.expire_deadlines() == 1
    assert store.record("r")["state"] == "TIMED_OUT" and store.record("later")["state"] == "QUEUED"
    assert store.client.zcard(store.keys.deadlines) == 1


def test_claim_skips_requests_cancelled_after_the_snapshot(store):
    store.submit(spec("keep"))
    store.submit(spec("gone"))
    store.end("gone", Ending(State.CANCELLED, "cancelled"))
    got = store.claim([("keep", "d1"), ("gone", "d1")], "p1")
    assert [(c.epoch, bool(c.spec)) for c in got] == [(1, True), (0, False)]
    assert pb.RequestSpec.FromString(got[0].spec).request_id == "keep"


# -- leases and dead workers ----------------------------------------------------------------------

def test_a_claim_leases_the_attempt_to_both_workers_until_decoding(store):
    store.submit(spec("r"))
    claim(store, "r", prefill="p1", decode="d1")
    k = store.keys
    assert store.client.sismember(k.held("p1"), "r") and store.client.sismember(k.held("d1"), "r")
    assert store.client.zscore(k.leases, "r") > now_ms()
    store.transition("r", 1, State.DECODING)
    assert store.client.zscore(k.leases, "r") is None


def test_a_dead_decode_worker_loses_its_requests_to_the_queue_under_a_new_epoch(store):
    to_state(store, "r", State.DECODING)
    assert store.reap_worker("d1", max_attempts=3) == (1, 0)
    rec = store.record("r")
    assert (rec["state"], rec["epoch"], "stopped heartbeating" in rec["error"]) == ("QUEUED", "2", True)
    assert queued(store) == ["r"] and not store.client.exists(store.keys.held("d1"))
    assert store.step([StepItem("r", 1, 1, 8, "b")]) == [False]  # the old attempt is fenced off
    assert claim(store, "r", decode="d2") == [3]


def test_a_dead_prefill_worker_loses_only_what_it_has_not_handed_off(store):
    to_state(store, "handed", State.DECODING)
    to_state(store, "mid", State.PREFILLING)
    assert store.reap_worker("p1", max_attempts=3) == (1, 0)
    assert store.record("handed")["state"] == "DECODING" and store.record("mid")["state"] == "QUEUED"


def test_failed_attempts_are_bounded_then_the_request_fails_with_a_reason(store):
    store.submit(spec("r"))
    for attempt in range(3):
        epoch = claim(store, "r", decode=f"d{attempt}")[0]
        assert store.requeue("r", epoch, f"KV hand-off {attempt} failed", 3) == ("QUEUED" if attempt < 2 else "FAILED")
    rec = store.record("r")
    assert rec["state"] == "FAILED" and rec["error"] == "KV hand-off 2 failed" and rec["failures"] == "3"
    assert [f[b"done"] for _, f in store.client.xrange(store.keys.output("r")) if b"done" in f] == [b"FAILED"]
    clean(store, "r")


def test_lost_attempts_do_not_count_towards_max_attempts_and_are_bounded_apart(redis_client, prefix):
    store = SyncStore(redis_client, prefix, 60, RetryLimits(max_lost=4))
    store.submit(spec("r"))
    for attempt in range(4):
        assert claim(store, "r", decode=f"d{attempt}") != [0]
        assert store.reap_worker(f"d{attempt}", max_attempts=1) == ((1, 0) if attempt < 3 else (0, 1))
    rec = store.record("r")
    assert rec["state"] == "FAILED" and rec["lost"] == "4" and "failures" not in rec
    assert rec["error"].startswith("worker d3 stopped heartbeating (4 attempts lost")
    clean(store, "r")


def test_a_failed_attempt_is_held_back_and_avoids_its_workers_a_lost_one_is_not(store):
    store.submit(spec("failed"))
    store.submit(spec("lost"))
    claim(store, "failed", "lost", prefill="p1", decode="d1")
    before = now_ms()
    assert store.requeue("failed", 1, "KV hand-off failed", 3) == "QUEUED"
    assert store.requeue("lost", 1, "prefill worker shutting down", 3, kind=LOST) == "QUEUED"
    rec = store.record("failed")
    assert rec["avoid"] == "p1 d1" and before + 500 <= int(rec["retry_at"]) <= now_ms() + 500
    assert "avoid" not in store.record("lost") and "retry_at" not in store.record("lost")
    snap = store.snapshot([T], 10, 10)
    assert [h.request_id for h in snap[T][0].heads] == ["lost"]  # held back until its retry_at
    assert snap.next_retry_ms == int(rec["retry_at"])
    store.client.hset(store.keys.request("failed"), "retry_at", now_ms() - 1)
    heads = store.snapshot([T], 10, 10)[T][0].heads
    assert [(h.request_id, h.avoid) for h in heads] == [("failed", {"p1", "d1"}), ("lost", frozenset())]


def test_the_backoff_doubles_per_failure_up_to_its_cap(redis_client, prefix, monkeypatch):
    import pdq.state.store
    monkeypatch.setattr(pdq.state.store, "now_ms", lambda: 10_000)  # the time the scripts are given
    store = SyncStore(redis_client, prefix, 60, RetryLimits(backoff_ms=1000, backoff_max_ms=3000))
    store.submit(spec("r"))
    waits = []
    for attempt in range(4):
        epoch = claim(store, "r", decode=f"d{attempt}")[0]
        store.requeue("r", epoch, "error", 10)
        waits.append(int(store.record("r")["retry_at"]) - 10_000)
    assert waits == [1000, 2000, 3000, 3000]
    assert store.record("r")["avoid"].split() == ["d0", "d1", "d2", "p1", "d3"]  # latest last, each once


def test_an_expired_prefill_lease_requeues_the_request(store):
    store.submit(spec("r"))
    store.claim([("r", "d1")], "p1", lease_ms=-1)
    store.submit(spec("fresh"))
    store.claim([("fresh", "d1")], "p1")
    assert store.expire_leases(max_attempts=3) == (1, 0)
    assert store.record("r")["state"] == "QUEUED" and store.record("fresh")["state"] == "PREFILLING"
    assert store.record("r")["error"] == "prefill lease expired"


# -- operator controls ------------------------------------------------------------------------------

def test_a_paused_tier_or_tenant_is_left_out_of_the_snapshot_and_stays_queued(store):
    store.submit(spec("a1", "a"))
    store.submit(spec("b1", "b"))
    store.submit(spec("x1", "a", tier="batch"))
    store.pause(tenant="a")
    store.pause(tier="batch")
    assert store.paused() == (["batch"], ["a"])
    snap = store.snapshot([T, "batch"], 1, 10)
    assert [t.tenant for t in snap[T]] == ["b"] and snap["batch"] == []
    store.pause(tenant="a", paused=False)
    assert [t.tenant for t in store.snapshot([T], 10, 10)[T]] == ["a", "b"]
    assert store.record("a1")["state"] == "QUEUED"


def test_cancel_tenant_ends_its_live_requests_in_every_state(store):
    for state in LIVE:
        to_state(store, f"r-{state.value}", state)
    store.submit(spec("other", "globex"))
    assert store.end_tenant("acme", Ending.cancelled("operator")) == 4
    assert {store.record(f"r-{s.value}")["state"] for s in LIVE} == {"CANCELLED"}
    assert store.record("other")["state"] == "QUEUED"
    assert store.end_tenant("acme", Ending.cancelled("operator")) == 0
    assert store.load()["running"] == 0


def test_set_deadline_moves_a_live_requests_deadline(store):
    store.submit(spec("r", deadline_ms=now_ms() + 60_000))
    assert store.set_deadline("r", 1) == State.QUEUED
    assert store.expire_deadlines() == 1 and store.record("r")["state"] == "TIMED_OUT"
    assert store.set_deadline("r", now_ms() + 1000) == State.TIMED_OUT  # ended: unchanged
    assert store.set_deadline("nope", 1) is None


def test_tenant_policies_are_listed(store):
    store.set_tenant_policy("b", TenantPolicy(weight=2.0))
    store.set_tenant_policy("a", TenantPolicy(tier="batch"))
    assert store.tenants() == ["a", "b"]
    assert store.tenant_policy("a") == TenantPolicy(tier="batch")
    store.set_tenant_policy("a", TenantPolicy())
    assert store.tenants() == ["b"]
