"""The pure scheduling policies: unit tests and hypothesis properties (no Redis)."""

import itertools

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from pdq.config import FAIR_POLICIES, ORDER_POLICIES, TIER_POLICIES, SchedulerConfig
from scheduler import janitor
from scheduler.policies import (FAIR_POLICIES as FAIR_IMPL, ORDER_POLICIES as ORDER_IMPL, FIFO, VTC, AgingTiers,
                                Candidate, DrainRate, StrictTiers, TenantQueue, TierQueue, form_batch, resolve_tier,
                                retry_after_ms, schedule, tier_policy)
from scheduler.policies.order import edf, fcfs, sjf

NOW = 1_000_000


def cand(rid, prompt=10, max_tokens=10, tenant="a", tier="interactive", created=NOW, deadline=0):
    return Candidate(rid, prompt, max_tokens, tenant, tier, deadline, created)


def tenant_queue(name, heads, counter=0.0, weight=1.0):
    return TenantQueue(name, counter, weight, list(heads))


def ids(cands):
    return [c.request_id for c in cands]


# -- names ------------------------------------------------------------------------------------

def test_every_policy_name_the_config_accepts_has_an_implementation():
    assert set(ORDER_POLICIES) == set(ORDER_IMPL)
    assert set(FAIR_POLICIES) == set(FAIR_IMPL)
    assert {type(tier_policy(n, 1)).__name__ for n in TIER_POLICIES} == {"AgingTiers", "StrictTiers"}
    for name in ("tier_policy", "fair_policy", "order_policy"):
        try:
            SchedulerConfig(**{name: "nope"})
        except ValueError as exc:
            assert name in str(exc)
        else:
            raise AssertionError(f"{name} accepted an unknown name")


# -- inside a tenant ---------------------------------------------------------------------------

def order_by(policy, reqs):
    """reqs: (seq, prompt, max_tokens, deadline) -> seqs in queue order (ties: lowest member, as Redis)."""
    return [r[0] for r in sorted(reqs, key=lambda r: (policy(*r), str(r[0])))]


def test_fcfs_is_arrival_order():
    assert order_by(fcfs, [(3, 1, 1, 0), (1, 900, 900, 0), (2, 5, 5, 0)]) == [1, 2, 3]


def test_sjf_is_shortest_prompt_plus_max_tokens_then_arrival():
    assert order_by(sjf, [(1, 100, 100, 0), (2, 10, 10, 0), (3, 15, 5, 0), (4, 1, 1, 0)]) == [4, 2, 3, 1]


def test_edf_is_earliest_deadline_then_no_deadline_in_arrival_order():
    assert order_by(edf, [(1, 1, 1, 0), (2, 1, 1, NOW + 500), (3, 1, 1, NOW + 100), (4, 1, 1, 0)]) == [3, 2, 1, 4]


@given(st.lists(st.tuples(st.integers(1, 2**31), st.integers(1, 2**19), st.integers(1, 2**19),
                          st.integers(0, 2**42)), min_size=2, max_size=30, unique_by=lambda r: r[0]))
def test_order_scores_are_exact_and_respect_their_keys(reqs):
    for a, b in itertools.combinations(reqs, 2):
        if a[1] + a[2] != b[1] + b[2]:
            assert (sjf(*a) < sjf(*b)) == (a[1] + a[2] < b[1] + b[2])
        else:
            assert (sjf(*a) < sjf(*b)) == (a[0] < b[0])
        assert float(sjf(*a)) == sjf(*a) and float(edf(*a)) == edf(*a)  # exact in a Redis score
        if a[3] and b[3] and a[3] != b[3]:
            assert (edf(*a) < edf(*b)) == (a[3] < b[3])
        if a[3] and not b[3]:
            assert edf(*a) < edf(*b)


# -- between tiers -----------------------------------------------------------------------------

def two_tiers(interactive, batch):
    return [TierQueue("interactive", 0, [tenant_queue("a", interactive)]),
            TierQueue("batch", 1, [tenant_queue("a", batch)])]


def test_strict_tiers_serve_the_best_tier_first():
    order = schedule(two_tiers([cand("i1", created=NOW), cand("i2", created=NOW)], [cand("b1", created=0)]),
                     NOW, StrictTiers(), VTC())
    assert ids(order) == ["i1", "i2", "b1"]


def test_aging_lifts_a_request_that_waited_long_enough():
    tiers = two_tiers([cand("i1", created=NOW - 10), cand("i2", created=NOW)], [cand("b1", created=NOW - 1000)])
    assert ids(schedule(tiers, NOW, AgingTiers(aging_ms=5000), VTC())) == ["i1", "i2", "b1"]  # not yet
    assert ids(schedule(tiers, NOW, AgingTiers(aging_ms=1000), VTC())) == ["b1", "i1", "i2"]  # older, aged


@settings(max_examples=200)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=12), st.lists(st.integers(0, 50_000), min_size=1,
       max_size=12), st.lists(st.integers(0, 50_000), max_size=6), st.integers(1, 20_000), st.integers(0, 60_000))
def test_aged_requests_are_never_overtaken_by_younger_ones(inter, batch, bulk, aging_ms, now):
    """The aging bound: a request at the head of tier r that has waited r * aging_ms goes before
    every request that arrived after it, whatever its tier."""
    tiers = [TierQueue("interactive", 0, [tenant_queue("a", [cand(f"i{k}", tier="interactive", created=c)
                                                                  for k, c in enumerate(sorted(inter))])]),
             TierQueue("batch", 1, [tenant_queue("a", [cand(f"b{k}", tier="batch", created=c)
                                                            for k, c in enumerate(sorted(batch))])]),
             TierQueue("bulk", 2, [tenant_queue("a", [cand(f"x{k}", tier="bulk", created=c)
                                                           for k, c in enumerate(sorted(bulk))])])]
    rank = {"interactive": 0, "batch": 1, "bulk": 2}
    order = list(schedule(tiers, now, AgingTiers(aging_ms), VTC()))
    assert len(order) == len(inter) + len(batch) + len(bulk)
    for i, x in enumerate(order):
        if now - x.created_ms >= rank[x.tier] * aging_ms:
            # x was the head of its tier: nothing chosen before it arrived after it
            # (within a tier the order is FCFS, so its earlier tier-mates are older anyway)
            assert all(y.created_ms <= x.created_ms for y in order[:i]), (x, order[:i])


# -- between tenants -----------------------------------------------------------------------------

def flood(tenant, n, cost, start=0):
    return [cand(f"{tenant}{k}", prompt=cost // 2, max_tokens=cost - cost // 2, tenant=tenant, created=start + k)
            for k in range(n)]


def test_vtc_shares_tokens_between_a_flood_and_a_trickle():
    heavy = tenant_queue("heavy", flood("heavy", 200, 100))
    light = tenant_queue("light", flood("light", 20, 100, start=1000))
    first_40 = list(itertools.islice(schedule([TierQueue("t", 0, [heavy, light])], NOW, StrictTiers(), VTC()), 40))
    assert sum(c.tenant == "light" for c in first_40) == 20


def test_fifo_serves_in_arrival_order_across_tenants():
    heavy = tenant_queue("heavy", flood("heavy", 30, 100))
    light = tenant_queue("light", flood("light", 5, 100, start=1000))
    order = list(schedule([TierQueue("t", 0, [heavy, light])], NOW, StrictTiers(), FIFO()))
    assert ids(order[:30]) == [f"heavy{k}" for k in range(30)]


def test_schedule_leaves_its_inputs_alone():
    q = tenant_queue("a", flood("a", 3, 10))
    tiers = [TierQueue("t", 0, [q])]
    assert len(list(schedule(tiers, NOW, StrictTiers(), VTC()))) == 3
    assert q.counter == 0 and q.taken == 0 and len(list(schedule(tiers, NOW, StrictTiers(), VTC()))) == 3


costs = st.lists(st.integers(1, 4000), min_size=1, max_size=40)


@settings(max_examples=200)
@given(costs, costs, st.sampled_from([(1.0, 1.0), (2.0, 1.0), (1.0, 3.0), (0.5, 0.5)]))
def test_vtc_bounds_the_service_gap_between_backlogged_tenants(a_costs, b_costs, weights):
    """Two tenants backlogged from the same counter: at every point of the order, their weighted
    services differ by at most one request's weighted cost (the VTC fairness bound)."""
    wa, wb = weights
    qa = TenantQueue("a", 0.0, wa, [cand(f"a{k}", c, 0, "a") for k, c in enumerate(a_costs)])
    qb = TenantQueue("b", 0.0, wb, [cand(f"b{k}", c, 0, "b") for k, c in enumerate(b_costs)])
    bound = max(max(a_costs) / wa, max(b_costs) / wb)
    served = {"a": 0.0, "b": 0.0}
    left = {"a": len(a_costs), "b": len(b_costs)}
    for c in schedule([TierQueue("t", 0, [qa, qb])], NOW, StrictTiers(), VTC()):
        served[c.tenant] += c.kv_tokens / (wa if c.tenant == "a" else wb)
        left[c.tenant] -= 1
        if left["a"] and left["b"]:  # both still backlogged
            assert abs(served["a"] - served["b"]) <= bound


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 500)), min_size=1, max_size=60),
       st.dictionaries(st.sampled_from("abc"), st.floats(0, 1e6), min_size=3, max_size=3))
def test_vtc_always_picks_the_lowest_counter(reqs, counters):
    queues = [TenantQueue(t, counters[t], 1.0, [cand(f"{t}{k}", c, 0, t) for k, (tt, c) in enumerate(reqs) if tt == t])
              for t in "abc"]
    live = {q.tenant: q.counter for q in queues}
    remaining = {q.tenant: len(q.heads) for q in queues}
    for c in schedule([TierQueue("t", 0, queues)], NOW, StrictTiers(), VTC()):
        assert live[c.tenant] == min(v for t, v in live.items() if remaining[t])
        live[c.tenant] += c.kv_tokens
        remaining[c.tenant] -= 1


# -- batches -------------------------------------------------------------------------------------

def test_form_batch_respects_count_and_token_budget_in_order():
    reqs = [cand("r0", 10), cand("r1", 20), cand("r2", 30), cand("r3", 40)]
    assert ids(form_batch(reqs, 10, 60)) == ["r0", "r1", "r2"]
    assert ids(form_batch(reqs, 2, 1000)) == ["r0", "r1"]
    assert ids(form_batch([cand("big", 5000), cand("small", 10)], 8, 100)) == ["big"]  # oversized goes alone


def test_form_batch_reads_the_order_lazily():
    pulled = []

    def order():
        for k in itertools.count():
            pulled.append(k)
            yield cand(f"r{k}", 1)
    assert len(form_batch(order(), 4, 1000)) == 4 and len(pulled) == 4


# -- admission -----------------------------------------------------------------------------------

def test_resolve_tier_defaults_to_the_best_and_caps_at_the_tenants_tier():
    tiers = ["interactive", "batch"]
    assert resolve_tier("", None, tiers) == "interactive"
    assert resolve_tier("batch", None, tiers) == "batch"
    assert resolve_tier("interactive", "batch", tiers) == "batch"
    assert resolve_tier("batch", "interactive", tiers) == "batch"
    assert resolve_tier("vip", None, tiers) is None


def test_retry_hint_follows_the_drain_rate_within_bounds():
    assert retry_after_ms(1000, 2000.0, 100, 30000) == 500
    assert retry_after_ms(1, 2000.0, 100, 30000) == 100
    assert retry_after_ms(10**9, 1.0, 100, 30000) == 30000
    assert retry_after_ms(1000, 0.0, 100, 30000) == 30000  # nothing moving: the longest hint


def test_drain_rate_counts_the_last_window():
    rate = DrainRate(window_s=10)
    rate.add(0.0, 500)
    rate.add(5.0, 500)
    assert rate.rate(5.0) == 100
    assert rate.rate(12.0) == 50
    assert rate.rate(100.0) == 0


def test_janitor_sleep_is_until_the_earliest_deadline_or_reap_within_bounds():
    assert janitor.sleep_s(None, 1_000, 100.0) == janitor.MAX_SLEEP_S
    assert janitor.sleep_s(1_300, 1_000, 100.0) == pytest.approx(0.3)
    assert janitor.sleep_s(1_300, 1_000, 0.1) == pytest.approx(0.1)  # a reap is due first
    assert janitor.sleep_s(900, 1_000, 5.0) == janitor.MIN_SLEEP_S  # overdue: soon, never a spin
