"""Pure policies: batch forming, decode worker choice, prefill chunk planning."""

from hypothesis import given
from hypothesis import strategies as st

from pdq.engine.batch_policy import waits_for_shared_prefix
from scheduler.policies import Candidate, DecodeSlots, choose_decode_worker, form_batch


def cands(*prompts):
    return [Candidate(f"r{i}", p, 8) for i, p in enumerate(prompts)]


def test_form_batch_respects_count_and_token_budget_in_order():
    assert [c.request_id for c in form_batch(cands(10, 20, 30, 40), 10, 60)] == ["r0", "r1", "r2"]
    assert [c.request_id for c in form_batch(cands(10, 20, 30), 2, 1000)] == ["r0", "r1"]
    assert [c.request_id for c in form_batch(cands(5000, 10), 8, 100)] == ["r0"]  # oversized goes alone


def test_choose_decode_worker_takes_most_free_slots():
    ws = [DecodeSlots("a", "h:1", 2), DecodeSlots("b", "h:2", 5), DecodeSlots("c", "h:3", 0)]
    assert choose_decode_worker(ws).worker_id == "b"
    assert choose_decode_worker([DecodeSlots("a", "h:1", 0)]) is None


def test_choose_decode_worker_prefers_the_colocated_one_while_it_has_room():
    ws = [DecodeSlots("a", "h:1", 2), DecodeSlots("b", "h:2", 5)]
    assert choose_decode_worker(ws, local="h:1").worker_id == "a"  # fewer free slots, but no transfer
    assert choose_decode_worker(ws, local="h:9").worker_id == "b"  # no decode worker there
    ws[0].free_slots = 0
    assert choose_decode_worker(ws, local="h:1").worker_id == "b"  # full: elsewhere, over the wire


@given(st.lists(st.integers(2, 3000), min_size=1, max_size=20), st.integers(1, 4096), st.integers(1, 1024))
def test_prompt_chunks_of_a_step_stay_in_the_budget_and_the_first_always_runs(remaining, budget, chunk):
    from pdq.engine.batch_policy import BatchPolicy, SeqView
    plan = BatchPolicy(max_batched_tokens=budget, prefill_chunk=chunk).schedule(
        [SeqView(i, need) for i, need in enumerate(remaining)], [], 0)
    lengths = {c.seq_id: c.length for c in plan.prefill}
    assert all(0 < n <= min(remaining[i], chunk) for i, n in lengths.items())
    assert lengths.get(0, 0) >= 1  # progress every step
    assert sum(lengths.values()) <= budget and not plan.decode


def test_a_prompt_waits_only_for_full_blocks_another_is_computing_that_the_cache_lacks():
    system = list(range(100, 164))  # four blocks of 16
    a, b = system + [1, 2, 3], system + [7, 8]
    assert waits_for_shared_prefix(b, lambda: 0, [a], 16)  # a computes the four blocks b would compute again
    assert not waits_for_shared_prefix(b, lambda: 64, [a], 16)  # the cache holds them already
    assert waits_for_shared_prefix(b, lambda: 32, [a], 16)  # two of four held: the other two are worth the wait
    assert not waits_for_shared_prefix(b, lambda: 0, [[9] + a], 16)  # shifted: no block in common
    assert not waits_for_shared_prefix(system[:16], lambda: 0, [system], 16)  # its one full block holds its last token
    assert waits_for_shared_prefix(system[:17], lambda: 0, [system], 16)
    assert not waits_for_shared_prefix(b, lambda: 0, [], 16)
    other = [5] * 16 + system[16:]  # agrees from block 1 on, not in block 0: nothing shareable
    assert not waits_for_shared_prefix(b, lambda: 16, [other], 16)


def test_a_request_finding_no_seat_may_preempt_only_tiers_below_its_own():
    from scheduler.policies import preemptible_tiers

    tiers = ["interactive", "standard", "batch"]
    assert preemptible_tiers(tiers, "interactive", 0) == ("standard", "batch")
    assert preemptible_tiers(tiers, "standard", 0) == ("batch",)
    assert preemptible_tiers(tiers, "batch", 0) == ()  # the worst tier preempts nobody
    assert preemptible_tiers(tiers, "interactive", 1) == ()  # a free seat somewhere: no preemption
    assert preemptible_tiers(tiers, "unknown", 0) == ()


def test_the_victim_is_the_worst_tiers_newest_sequence():
    from types import SimpleNamespace as S

    from decode_worker.loop import preempt_victim

    seqs = [S(rid="b-old", labels=("batch", "t"), arrived=1.0, done=False),
            S(rid="s-new", labels=("standard", "t"), arrived=9.0, done=False),
            S(rid="b-new", labels=("batch", "t"), arrived=5.0, done=False),
            S(rid="b-done", labels=("batch", "t"), arrived=7.0, done=True),
            S(rid="i", labels=("interactive", "t"), arrived=8.0, done=False)]
    assert preempt_victim(seqs, ("standard", "batch")).rid == "b-new"
    assert preempt_victim(seqs, ("standard",)).rid == "s-new"
    assert preempt_victim(seqs[:1], ("standard",)) is None


def test_a_dispatch_rounds_placement_fills_seats_in_order_and_keeps_the_reserve_for_tenants_below_share():
    from scheduler.policies import Headroom, decode_chooser, place_round

    slots = [DecodeSlots("d1", "p:1", 2), DecodeSlots("d2", "d:2", 1)]
    batch = [Candidate("a1", 10, 8, "flood"), Candidate("a2", 10, 8, "flood"), Candidate("b1", 10, 8, "light"),
             Candidate("a3", 10, 8, "flood")]
    running = {"flood": 6}  # the flood holds 6 of 9 seats; light holds none
    plans = place_round(batch, slots, "p:1", Headroom(1), 9, running, {"flood": 1.0, "light": 1.0},
                        {"flood", "light"}, decode_chooser())
    # a1 takes the colocated worker's seat; a2 too (two free remain); the last seat is the reserve:
    # light (below its share) gets it, a3 (the flood, above its share) waits
    assert [(p.candidate.request_id, p.worker.worker_id, p.under_share) for p in plans] == [
        ("a1", "d1", False), ("a2", "d1", False), ("b1", "d2", True)]
    assert [p.keep_free for p in plans] == [0, 0, 0]  # d2's free seat covered the reserve when d1 granted
    one = place_round(batch[:1], [DecodeSlots("d1", "p:1", 2)], "p:1", Headroom(1), 9, {"flood": 6},
                      {"flood": 1.0, "light": 1.0}, {"flood", "light"}, decode_chooser())
    assert [p.keep_free for p in one] == [1]  # alone, d1 must still have more than one seat free to grant
    assert [s.free_slots for s in slots] == [0, 0] and running == {"flood": 8, "light": 1}
    alone = place_round([Candidate("x", 1, 1, "solo", avoid=frozenset({"d1"}))],
                        [DecodeSlots("d1", "p:1", 3), DecodeSlots("d2", "d:2", 0)], "p:1", Headroom(1), 3, {},
                        {}, set(), decode_chooser())
    assert alone == []  # the only worker with room is one its failed attempt avoids: it waits
