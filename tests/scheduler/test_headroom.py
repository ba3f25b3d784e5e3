"""The decode pool's last free slots are kept for tenants below their fair share."""

from hypothesis import given
from hypothesis import strategies as st

from scheduler.policies import Headroom


def test_a_flooding_tenant_leaves_the_last_slot_to_a_tenant_below_its_share():
    h = Headroom(reserve=1)
    running = {"heavy": 7}
    active = {"heavy", "light"}
    assert not h.allows("heavy", 1, 8, running, {}, active)  # heavy holds 7 of 8 > its share of 4
    assert h.allows("light", 1, 8, running, {}, active)
    assert h.allows("heavy", 2, 8, running, {}, active)  # more free than the reserve: anyone


def test_a_worker_keeps_free_what_the_reserve_needs_beyond_the_other_workers_free_slots():
    h = Headroom(reserve=1)
    assert h.keep_free(under_share=True, free=1, worker_free=1) == 0  # below its share: the last slot too
    assert h.keep_free(under_share=False, free=3, worker_free=3) == 1  # one worker: its last slot stays
    assert h.keep_free(under_share=False, free=3, worker_free=1) == 0  # two free elsewhere: this one may go
    assert Headroom(reserve=2).keep_free(False, free=3, worker_free=2) == 1
    assert Headroom(reserve=0).keep_free(False, free=1, worker_free=1) == 0


def test_a_tenant_alone_uses_the_whole_pool():
    h = Headroom(reserve=1)
    assert h.allows("heavy", 1, 8, {"heavy": 7}, {}, {"heavy"})
    assert h.allows("heavy", 1, 8, {"heavy": 7}, {}, set())


def test_weights_set_the_share_and_zero_reserve_turns_it_off():
    active = {"a", "b"}
    assert Headroom(1).allows("a", 1, 8, {"a": 5}, {"a": 3.0, "b": 1.0}, active)  # share 6
    assert not Headroom(1).allows("a", 1, 8, {"a": 6}, {"a": 3.0, "b": 1.0}, active)
    assert Headroom(0).allows("a", 1, 8, {"a": 7}, {}, active)
    assert not Headroom(0).allows("a", 0, 8, {}, {}, active)  # no free slot: nobody


@given(capacity=st.integers(1, 64), reserve=st.integers(0, 8), tenants=st.integers(2, 5), data=st.data())
def test_someone_below_its_share_can_always_take_a_free_slot(capacity, reserve, tenants, data):
    """No slot is ever left unusable by everyone: while a slot is free, a tenant below its
    share may take it (some tenant is below its share unless every slot is held)."""
    names = [f"t{i}" for i in range(tenants)]
    weights = {n: data.draw(st.floats(0.1, 10)) for n in names}
    free = data.draw(st.integers(1, capacity))
    held = capacity - free
    cuts = sorted(data.draw(st.lists(st.integers(0, held), min_size=tenants - 1, max_size=tenants - 1)))
    running = {n: b - a for n, a, b in zip(names, [0, *cuts], [*cuts, held])}
    h = Headroom(reserve)
    assert any(h.allows(n, free, capacity, running, weights, set(names)) for n in names)


def test_below_share_and_prefill_priority():
    from scheduler.policies import below_share, prefill_priority

    active = {"heavy", "light"}
    assert below_share("light", 8, {"heavy": 7}, {}, active)
    assert not below_share("heavy", 8, {"heavy": 4}, {}, active)  # at its share of 4
    assert below_share("heavy", 8, {"heavy": 7}, {}, {"heavy"})  # alone
    assert below_share("heavy", 8, {"heavy": 5}, {"heavy": 3.0}, active)  # weight 3: share 6
    assert [prefill_priority(0, True), prefill_priority(0, False), prefill_priority(1, True)] == [0, 1, 2]
