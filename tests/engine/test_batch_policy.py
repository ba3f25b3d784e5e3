"""BatchPolicy on plain data: decode first, chunked prefill under the budget, admission limits."""

import pytest

from pdq.engine import BatchPolicy, Chunk, SeqView


def test_decode_first_then_partial_prefill_then_admit():
    policy = BatchPolicy(max_batched_tokens=100, prefill_chunk=40, max_num_seqs=8)
    running = [SeqView("d1", 51, 50), SeqView("p", 300, 80), SeqView("d2", 11, 10)]
    waiting = [SeqView("w1", 30), SeqView("w2", 500), SeqView("w3", 5)]
    plan = policy.schedule(running, waiting, free_slots=5)
    assert plan.decode == ["d1", "d2"]
    assert plan.prefill == [Chunk("p", 80, 40), Chunk("w1", 0, 30), Chunk("w2", 0, 28)]
    assert plan.admit == ["w1", "w2"]
    assert plan.num_tokens == 100


def test_admission_limited_by_slots_and_seats():
    policy = BatchPolicy(max_batched_tokens=1000, prefill_chunk=100, max_num_seqs=3)
    waiting = [SeqView(i, 10) for i in range(5)]
    assert policy.schedule([], waiting, free_slots=2).admit == [0, 1]
    assert policy.schedule([SeqView("r", 5, 4)], waiting, free_slots=9).admit == [0, 1]


def test_budget_caps_decodes_and_empty_plan():
    policy = BatchPolicy(max_batched_tokens=2, prefill_chunk=8, max_num_seqs=8)
    plan = policy.schedule([SeqView(i, 3, 2) for i in range(4)], [SeqView("w", 4)], free_slots=4)
    assert plan.decode == [0, 1] and not plan.prefill and plan.num_tokens == 2
    assert not policy.schedule([], [], free_slots=4)


def test_config_validated():
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchPolicy(prefill_chunk=0)
