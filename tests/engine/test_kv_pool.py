"""KVPool: paged storage in blocks, admission by free blocks, idempotent free, lossless write/read."""

import pytest
import torch

from pdq.engine import KVPool, KVPoolFull


def make_pool(blocks=8, block_size=4, max_seq_len=16, **kw) -> KVPool:
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=3, kv_budget_tokens=blocks * block_size,
                  max_seq_len=max_seq_len, dtype=torch.float32, device="cpu", block_size=block_size, **kw)


def test_a_sequence_holds_the_blocks_it_uses_not_a_max_seq_len_slot():
    pool = make_pool()
    assert (pool.num_blocks, pool.free_tokens) == (8, 32)
    for s in "abcdefgh":  # 8 short sequences in a pool that holds 2 of max_seq_len
        pool.allocate(s, [1, 2, 3])
    assert pool.free_tokens == 0 and not pool.can_allocate(1)
    with pytest.raises(KVPoolFull, match="1 blocks of 4 tokens needed, 0 free of 8"):
        pool.allocate("i", [1])
    pool.free("b")
    pool.free("b")  # idempotent
    pool.free("never-allocated")
    assert pool.free_tokens == 4
    pool.ensure("a", 8)  # a grows into the block b gave back
    assert len(pool.table("a")) == 2 and pool.free_tokens == 0
    with pytest.raises(KVPoolFull):
        pool.ensure("a", 9)
    with pytest.raises(ValueError, match="already"):
        pool.allocate("a", [1])
    with pytest.raises(ValueError, match="max_seq_len"):
        pool.allocate("z", reserve_tokens=17)


def test_reserving_ahead_takes_the_blocks_at_once():
    pool = make_pool()
    pool.allocate("a", [1, 2], reserve_tokens=16)
    assert len(pool.table("a")) == 4 and pool.free_tokens == 16
    u = pool.usage()
    assert (u.seqs, u.blocks_used, u.blocks_total, u.tokens_used, u.tokens_capacity) == (1, 4, 8, 16, 32)
    assert u.fraction == 0.5


def test_budget_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="holds no sequence"):
        make_pool(blocks=3, block_size=4, max_seq_len=16)


def test_write_then_read_round_trips_across_blocks_and_rename():
    pool = make_pool()
    pool.allocate("other", [9] * 5)  # the sequence's blocks are not the first ones
    pool.allocate(("in", 1), reserve_tokens=10)
    kv = torch.arange(2 * 2 * 2 * 10 * 3, dtype=torch.float32).view(2, 2, 2, 10, 3)
    pool.write(("in", 1), kv)
    pool.rename(("in", 1), "r")
    assert pool.length("r") == 10 and ("in", 1) not in pool
    assert torch.equal(pool.read("r", 10), kv)
    assert torch.equal(pool.read("r", 7), kv[:, :, :, :7])
    with pytest.raises(ValueError, match="block boundary"):
        pool.write("r", kv[:, :, :, :2], start=3)
    with pytest.raises(KeyError, match="no KV blocks"):
        pool.length(("in", 1))


def test_a_prompt_shares_the_cached_blocks_of_its_prefix():
    pool = make_pool()
    prompt = list(range(11))  # two full blocks and three tokens
    assert pool.allocate("a", prompt) == 0
    pool.record("a", 0, prompt)
    pool.set_length("a", 11)
    pool.commit("a")
    assert pool.allocate("b", prompt[:8] + [99, 98]) == 8  # both full blocks found
    assert pool.table("b")[:2] == pool.table("a")[:2]
    assert pool.allocate("c", prompt[:9]) == 8  # at least one token is always left to compute
    assert pool.allocate("d", prompt[:8]) == 4
    pool.free("a")
    pool.free("b")
    pool.free("c")
    pool.free("d")
    assert pool.free_tokens == 32 and pool.usage().blocks_cached == 2
    assert pool.allocate("e", prompt) == 8  # cached after every holder left


def test_without_prefix_cache_nothing_is_shared():
    pool = make_pool(prefix_cache=False)
    prompt = list(range(11))
    pool.allocate("a", prompt)
    pool.record("a", 0, prompt)
    pool.set_length("a", 11)
    pool.commit("a")
    assert pool.allocate("b", prompt) == 0
