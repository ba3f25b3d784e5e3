"""BatchPolicy on plain data: decode first, chunked prefill under the budget, admission limits."""

import pytest

from pdq.engine import BatchPolicy, Chunk, SeqView


def test_decode_first_then_partial_prefill_then_admit():
    policy = BatchPolicy(max_batched_tokens=100, prefill_chunk=40, max_num_seqs=8)
    running = [SeqView("d1", 51, 50), SeqView("p", 300, 80), SeqView("d2", 11, 10)]
    waiting = [SeqView("w1", 30), SeqView("w2", 500), SeqView("w3", 5)]
    plan = policy.schedule(running, waiting, free_blocks=50)
    assert plan.decode == ["d1", "d2"]
    assert plan.prefill == [Chunk("p", 80, 40), Chunk("w1", 0, 30), Chunk("w2", 0, 28)]
    assert plan.admit == ["w1", "w2"]
    assert plan.num_tokens == 100


def test_admission_limited_by_blocks_and_seats_in_order():
    policy = BatchPolicy(max_batched_tokens=1000, prefill_chunk=100, max_num_seqs=3)
    waiting = [SeqView(i, 10, blocks=2) for i in range(5)]
    assert policy.schedule([], waiting, free_blocks=5).admit == [0, 1]
    assert policy.schedule([SeqView("r", 5, 4)], waiting, free_blocks=90).admit == [0, 1]
    big_first = [SeqView("big", 10, blocks=9), SeqView("small", 10, blocks=1)]
    assert policy.schedule([], big_first, free_blocks=5).admit == []  # first come, first served: no overtaking


def test_a_cached_prefix_is_not_prefilled_again():
    policy = BatchPolicy(max_batched_tokens=1000, prefill_chunk=100, max_num_seqs=3)
    plan = policy.schedule([], [SeqView("w", 70, num_cached=64, blocks=1)], free_blocks=1)
    assert plan.prefill == [Chunk("w", 64, 6)] and plan.num_tokens == 6


def test_budget_caps_decodes_and_empty_plan():
    policy = BatchPolicy(max_batched_tokens=2, prefill_chunk=8, max_num_seqs=8)
    plan = policy.schedule([SeqView(i, 3, 2) for i in range(4)], [SeqView("w", 4)], free_blocks=4)
    assert plan.decode == [0, 1] and not plan.prefill and plan.num_tokens == 2
    assert not policy.schedule([], [], free_blocks=4)


def test_config_validated():
    with pytest.raises(ValueError, match="prefill_chunk"):
        BatchPolicy(prefill_chunk=0)
