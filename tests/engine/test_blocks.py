"""BlockManager on plain data: block tables, reference counts, the prefix cache's LRU eviction."""

import pytest

from pdq.engine.blocks import BlockManager, KVPoolFull, block_hashes


def named(manager: BlockManager, seq_id, tokens) -> None:
    manager.allocate(seq_id, tokens)
    manager.commit(seq_id, tokens)


def test_hash_chain_names_a_block_by_everything_before_it():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # the partial block is not named
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent=a[0]) == a[1:]


def test_shared_blocks_are_counted_and_freed_once_each_holder_left():
    m = BlockManager(num_blocks=6, block_size=4)
    named(m, "a", list(range(9)))  # 3 blocks, 2 named
    assert m.allocate("b", list(range(9))) == 8
    assert m.tables["b"][:2] == m.tables["a"][:2] and m.num_free == 2
    m.free("a")
    assert m.num_free == 3  # a's third block; the shared two are still held by b
    m.free("b")
    assert m.num_free == 6 and m.stats().cached == 2
    assert (m.queried_tokens, m.hit_tokens) == (18, 8)


def test_cached_blocks_are_evicted_least_recently_used_and_the_tail_first():
    m = BlockManager(num_blocks=4, block_size=2)
    named(m, "a", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] named, [5] not
    m.free("a")
    assert m.stats().cached == 2 and m.num_free == 4
    m.allocate("x", [7], reserve_tokens=6)  # 3 blocks: the unnamed one, then the tail of a's prefix
    assert m.cached_tokens([1, 2, 3, 4, 5]) == 2  # [1, 2] is still cached, [3, 4] was evicted
    with pytest.raises(KVPoolFull):
        m.allocate("y", [1, 2, 3, 4, 5])  # 3 blocks needed, 1 cached hit + 0 free
    assert m.num_free == 1 and "y" not in m.tables  # a refusal takes nothing


def test_a_duplicate_block_is_not_named_twice_and_frees_plainly():
    m = BlockManager(num_blocks=4, block_size=2)
    m.allocate("a", [1, 2, 3])
    m.allocate("b", [1, 2, 3])  # both computed before either was named
    m.commit("a", [1, 2, 3])
    m.commit("b", [1, 2, 3])
    m.free("b")
    assert m.stats().cached == 0 and m.num_free == 2
    m.free("a")
    assert m.stats().cached == 1


def test_grow_takes_blocks_as_positions_are_written():
    m = BlockManager(num_blocks=3, block_size=4)
    m.allocate("a", [1])
    m.ensure("a", 4)
    assert len(m.tables["a"]) == 1
    m.ensure("a", 9)
    assert len(m.tables["a"]) == 3
    with pytest.raises(KVPoolFull):
        m.ensure("a", 13)


def test_table_rows_follow_every_table_through_allocate_grow_free_and_rename():
    import random

    rng = random.Random(0)
    m = BlockManager(num_blocks=64, block_size=4)
    live: list = []
    for step in range(400):
        op = rng.random()
        if op < 0.35 and m.num_free > 4:
            seq = f"s{step}"
            m.allocate(seq, [rng.randrange(50) for _ in range(rng.randrange(1, 13))])
            live.append(seq)
        elif op < 0.7 and live:
            seq = rng.choice(live)
            try:
                m.ensure(seq, len(m.tables[seq]) * 4 + rng.randrange(1, 9))
            except KVPoolFull:
                pass
        elif op < 0.8 and live:
            old = rng.choice(live)
            live[live.index(old)] = new = f"r{step}"
            m.rename(old, new)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            m.free(seq)
        if live:
            width = max(len(m.tables[s]) for s in live)
            rows = m.table_rows(live, width + 2)  # wider than any table: the rest is valid blocks
            assert rows.dtype.name == "int32" and rows.shape == (len(live), width + 2)
            for seq, row in zip(live, rows.tolist()):
                table = m.tables[seq]
                assert row[:len(table)] == table
                assert all(0 <= b < 64 for b in row)
    # a freed sequence's row is reused by the next one, overwritten from its first block
    assert len(m.rows.slot) == len(live)
