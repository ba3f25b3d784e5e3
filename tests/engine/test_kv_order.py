"""The pure policy of grouped decode attention: what it reads, and when sorting the pool pays."""

from hypothesis import given
from hypothesis import strategies as st

from pdq.engine.kv_order import GROUP, groups, padded_reads, sort_order, worth_grouping

lengths_lists = st.lists(st.integers(1, 2048), min_size=1, max_size=64)


@given(lengths_lists)
def test_groups_cover_every_slot_once_and_read_each_ones_keys(lengths):
    covered = [s for first, end, _ in groups(lengths) for s in range(first, end)]
    assert covered == list(range(len(lengths)))
    assert all(longest == max(lengths[first:end]) for first, end, longest in groups(lengths))
    assert sum(lengths) <= padded_reads(lengths) <= len(lengths) * max(lengths)


@given(lengths_lists)
def test_a_sorted_pool_reads_no_more_and_is_not_sorted_again(lengths):
    order = sort_order(lengths)
    if order is not None:
        assert sorted(order) == list(range(len(lengths)))
        after = [lengths[s] for s in order]
        assert padded_reads(after) < padded_reads(lengths)
        assert sort_order(after) is None


def test_grouping_only_when_it_saves_enough():
    assert not worth_grouping([100] * 32)  # equal lengths: one call reads nothing extra
    assert not worth_grouping([5, 300] * (GROUP // 2))  # one group: nothing to split
    assert worth_grouping([300] * GROUP + [20] * (3 * GROUP))  # short groups stop early
    assert not worth_grouping([300, 20, 20, 20] * GROUP)  # every group holds a long one
    assert sort_order([300, 20, 20, 20] * GROUP) is not None  # ... until the pool is sorted
