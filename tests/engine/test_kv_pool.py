"""KVPool: budget, KVPoolFull, idempotent free, compaction keeps every sequence's K/V."""

import pytest
import torch

from pdq.engine import KVPool, KVPoolFull


def make_pool(slots=3, max_seq_len=8) -> KVPool:
    return KVPool(
        num_layers=2, num_kv_heads=2, head_dim=4, kv_budget_tokens=slots * max_seq_len + 5,
        max_seq_len=max_seq_len, dtype=torch.float32, device="cpu",
    )


def fill(pool: KVPool, seq_id, value: float, length: int):
    for layer in range(2):
        k, v = pool.view(seq_id, layer, length)
        k.fill_(value + layer)
        v.fill_(-value - layer)
    pool.set_length(seq_id, length)


def test_budget_full_and_free():
    pool = make_pool()
    assert (pool.capacity, pool.num_free) == (3, 3)
    for s in "abc":
        assert pool.can_allocate()
        pool.allocate(s)
    assert not pool.can_allocate() and pool.num_free == 0
    with pytest.raises(KVPoolFull):
        pool.allocate("d")
    pool.free("b")
    pool.free("b")  # idempotent
    pool.free("never-allocated")
    assert pool.num_free == 1
    pool.allocate("d")
    with pytest.raises(ValueError, match="already"):
        pool.allocate("d")


def test_budget_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="holds no sequence"):
        KVPool(
            num_layers=1, num_kv_heads=1, head_dim=2, kv_budget_tokens=7, max_seq_len=8,
            dtype=torch.float32, device="cpu",
        )


def test_free_compacts_without_losing_kv():
    pool = make_pool(slots=4)
    for i, s in enumerate("abcd"):
        pool.allocate(s)
        fill(pool, s, 10.0 * (i + 1), length=i + 2)
    pool.free("a")  # "d" moves into slot 0
    pool.free("c")
    assert sorted(pool.slot(s) for s in "bd") == [0, 1]  # live slots stay [0, num_used)
    for s, value, length in (("b", 20.0, 3), ("d", 40.0, 5)):
        assert pool.length(s) == length
        for layer in range(2):
            k, v = pool.view(s, layer, length)
            assert torch.all(k == value + layer) and torch.all(v == -value - layer)
    u = pool.usage()
    assert (u.seqs, u.capacity, u.tokens_cached, u.tokens_capacity) == (2, 4, 8, 32)
    assert u.fraction == 0.5
    with pytest.raises(KeyError):
        pool.slot("a")


def test_a_slot_written_under_pinned_keeps_its_kv_through_moves_and_rename():
    pool = make_pool(slots=3)
    pool.allocate("a")
    fill(pool, "a", 1.0, length=2)
    pool.allocate(("in", 1))  # a hand-off being received, under a key of its own
    pool.set_length(("in", 1), 4)  # set first: a move keeps positions [0, length)
    with pool.pinned(("in", 1)) as kv:
        assert kv.shape == (2, 2, 2, 8, 4)
        kv[:, :, :, :4] = 5.0
    pool.free("a")  # moves the received slot into slot 0
    assert pool.slot(("in", 1)) == 0
    pool.rename(("in", 1), "r")
    assert ("in", 1) not in pool and pool.length("r") == 4 and pool.slot("r") == 0
    k, v = pool.view("r", 1, 4)
    assert torch.all(k == 5.0) and torch.all(v == 5.0)
    pool.allocate("b")
    with pytest.raises(ValueError, match="already"):
        pool.rename("b", "r")
    with pytest.raises(KeyError):
        pool.rename("gone", "c")


def test_reorder_moves_every_sequence_with_its_kv():
    pool = make_pool(slots=4)
    for i, s in enumerate("abcd"):
        pool.allocate(s)
        fill(pool, s, 10.0 * (i + 1), length=i + 2)
    pool.reorder([3, 1, 0, 2])  # slot i now holds the one that was in slot order[i]
    assert [pool.slot(s) for s in "dbac"] == [0, 1, 2, 3]
    assert pool.lengths() == [5, 3, 2, 4]
    for i, s in enumerate("abcd"):
        for layer in range(2):
            k, v = pool.view(s, layer, i + 2)
            assert torch.all(k == 10.0 * (i + 1) + layer) and torch.all(v == -10.0 * (i + 1) - layer)
    with pytest.raises(ValueError, match="permutation"):
        pool.reorder([0, 0, 1, 2])
