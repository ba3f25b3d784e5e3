"""The pure policies of retries and liveness: placement that keeps a failed request away from the
workers that failed it, failure kinds, quarantine decisions, and the janitor's judgement of dead
workers (unit tests and hypothesis properties, no Redis)."""

from hypothesis import given
from hypothesis import strategies as st

from scheduler.policies import (Candidate, DecodeSlots, HeartbeatWatch, Quarantine, acceptable, choose_decode_worker,
                                classify, place_prefill, prefer_healthy)
from scheduler.policies.retry import FAILURE, HANDOFF, LOST, LOST_ATTEMPT, REQUEST, UNSPECIFIED

CAP = 100


def cand(rid, avoid=()):
    return Candidate(rid, 10, 10, avoid=frozenset(avoid))


# -- placement ------------------------------------------------------------------------------------

def test_a_request_avoids_the_workers_that_failed_it_while_another_exists():
    assert not acceptable({"p0"}, "p0", ["p0", "p1"])
    assert acceptable({"p0"}, "p1", ["p0", "p1"])
    assert acceptable({"p0", "p1"}, "p0", ["p0", "p1"])  # it avoids every one: anywhere will do
    assert acceptable({"p0"}, "p0", ["p0"])


def test_without_failures_the_batch_goes_whole_to_the_least_loaded_prefill_worker():
    batch = [cand("a"), cand("b")]
    assert place_prefill(batch, [("p0", 50), ("p1", 10)], CAP) == ("p1", batch)
    assert place_prefill(batch, [("p1", 0), ("p0", 0)], CAP) == ("p0", batch)  # ties: by id
    assert place_prefill(batch, [("p0", CAP)], CAP) == (None, [])  # at its cap


def test_a_retried_request_goes_to_another_prefill_worker_and_the_rest_of_the_batch_with_it():
    batch = [cand("retry", avoid={"p0"}), cand("b"), cand("c", avoid={"p1"})]
    target, kept = place_prefill(batch, [("p0", 0), ("p1", 40)], CAP)
    assert target == "p1" and [c.request_id for c in kept] == ["retry", "b"]  # c waits for a worker it accepts


def test_a_retried_request_waits_for_its_other_worker_while_the_rest_go_on():
    batch = [cand("retry", avoid={"p0"}), cand("b")]
    target, kept = place_prefill(batch, [("p0", 0), ("p1", CAP)], CAP)  # p1 busy: the retry waits for it
    assert target == "p0" and [c.request_id for c in kept] == ["b"]


def test_a_retried_request_goes_to_another_decode_worker_or_waits_for_one():
    slots = [DecodeSlots("d0", "h:0", 4), DecodeSlots("d1", "h:1", 1)]
    assert choose_decode_worker(slots, avoid={"d0"}).worker_id == "d1"
    assert choose_decode_worker([DecodeSlots("d0", "h:0", 4), DecodeSlots("d1", "h:1", 0)], avoid={"d0"}) is None
    assert choose_decode_worker(slots, avoid={"d0", "d1"}).worker_id == "d0"  # avoids both: most free slots


@given(st.lists(st.tuples(st.sampled_from(["p0", "p1", "p2"]), st.integers(0, 2 * CAP)), min_size=1, max_size=3,
                unique_by=lambda x: x[0]),
       st.lists(st.frozensets(st.sampled_from(["p0", "p1", "p2"])), min_size=1, max_size=6))
def test_placement_sends_a_request_only_where_it_may_go_and_always_sends_something_when_it_can(loads, avoids):
    batch = [cand(f"r{i}", a) for i, a in enumerate(avoids)]
    usable = [w for w, _ in loads]
    target, kept = place_prefill(batch, loads, CAP)
    open_ = [w for w, n in loads if n < CAP]
    can = [c for c in batch if any(acceptable(c.avoid, w, usable) for w in open_)]
    if not can:
        assert (target, kept) == (None, [])
        return
    assert target in open_ and kept and kept[0] == can[0]
    assert all(acceptable(c.avoid, target, usable) for c in kept)
    assert [c for c in batch if c in kept] == kept  # in batch order
    if not any(c.avoid for c in batch):
        assert kept == batch and target == min(open_, key=lambda w: (dict(loads)[w], w))


# -- failure kinds and quarantine -------------------------------------------------------------------

def test_failures_are_the_requests_own_unless_the_worker_lost_the_attempt():
    assert classify(HANDOFF, "") == (FAILURE, True)
    assert classify(REQUEST, "KV hand-off to x: refused") == (FAILURE, False)  # the worker said so
    assert classify(LOST_ATTEMPT, "anything") == (LOST, False)
    assert classify(UNSPECIFIED, "KV hand-off to h:1: DATA_LOSS checksum mismatch") == (FAILURE, True)
    assert classify(UNSPECIFIED, "prefill worker shutting down") == (LOST, False)
    assert classify(UNSPECIFIED, "prefill failed: seed out of range") == (FAILURE, False)


def test_a_worker_is_quarantined_after_failures_with_several_partners_for_a_doubling_while():
    q = Quarantine(after=3, base_ms=1000, max_ms=5000)
    assert q.duration_ms(streak=3, peers=2, times=0, others_usable=1) == 1000
    assert q.duration_ms(3, 2, 1, 1) == 2000 and q.duration_ms(3, 2, 5, 1) == 5000
    assert q.duration_ms(2, 2, 0, 1) is None  # not yet
    assert q.duration_ms(9, 1, 0, 1) is None  # every failure with the same partner: who is to blame?
    assert q.duration_ms(9, 3, 0, 0) is None  # the last usable worker of its role


@given(st.integers(0, 20), st.integers(0, 8), st.integers(0, 40), st.integers(0, 3))
def test_a_quarantine_is_bounded_and_needs_evidence_against_the_worker(streak, peers, times, others):
    q = Quarantine(after=3, base_ms=1000, max_ms=600_000)
    got = q.duration_ms(streak, peers, times, others)
    if streak < 3 or peers < 2 or others < 1:
        assert got is None
    else:
        assert 1000 <= got <= 600_000 and got >= min(600_000, q.duration_ms(streak, peers, max(0, times - 1), others))


def test_quarantined_workers_are_used_only_when_no_other_is_usable():
    assert prefer_healthy(["a", "b"], lambda w: w == "a") == ["b"]
    assert prefer_healthy(["a"], lambda w: w == "a") == ["a"]


# -- the janitor's judgement of dead workers ------------------------------------------------------------

def watch(timeout=10.0):
    return HeartbeatWatch(timeout, timeout / 2)


def test_a_silent_worker_is_dead_after_the_timeout_of_unbroken_observation():
    w = watch()
    t = 0.0
    dead = []
    while not dead:
        t += 2.5
        dead = w.observe(t, {"alive": t, "silent": 1.0})
    assert dead == ["silent"] and t == 12.5  # first seen at 2.5, silent for 10 s of observation


def test_an_outage_is_not_taken_for_dead_workers():
    w = watch()
    for t in (0.0, 2.5, 5.0):
        assert w.observe(t, {"a": 100.0}) == []
    # Redis gone for 30 s: nobody could beat; the first read after it starts the observation over
    assert w.observe(35.0, {"a": 100.0}) == []
    assert not w.settled(35.0)
    assert w.observe(37.5, {"a": 100.0}) == [] and w.observe(40.0, {"a": 136.0}) == []  # it beats again
    assert w.settled(45.0)


def test_a_failed_redis_command_between_reads_starts_the_observation_over():
    w = watch()
    assert w.observe(0.0, {"a": 1.0}) == []
    assert w.observe(4.0, {"a": 1.0}) == [] and w.observe(8.0, {"a": 1.0}) == []
    assert w.observe(10.0, {"a": 1.0}, failed_at=9.0) == []  # would have been 10 s, but Redis failed at 9
    assert [w.observe(t, {"a": 1.0}, failed_at=9.0) for t in (14.0, 18.0, 20.0)] == [[], [], ["a"]]


@given(st.lists(st.tuples(st.floats(0.1, 6.0), st.booleans(), st.booleans()), min_size=1, max_size=60))
def test_no_worker_is_dead_before_a_full_timeout_of_unbroken_observation_without_a_beat(reads):
    """reads: (time since the previous read, whether worker "a" beat meanwhile, whether a Redis
    command failed meanwhile)."""
    timeout = 10.0
    w = watch(timeout)
    t, hb, quiet_since = 0.0, 0.0, None  # quiet_since: since when "a" was seen silent under unbroken observation
    last = None
    for gap, beat, failed in reads:
        t += gap
        hb += beat
        broken = last is None or t - last > timeout / 2 or failed
        if beat or broken or quiet_since is None:
            quiet_since = t
        dead = w.observe(t, {"a": hb}, failed_at=t - gap / 2 if failed else 0.0)
        assert (dead == ["a"]) == (t - quiet_since >= timeout)
        last = t
