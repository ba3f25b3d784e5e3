"""The sharding simulation (`pdq.bench.shard_sim`) and what docs/scaling.md claims from it: spread
requests keep fair share and scale throughput with the shards; pinning loses both once a shard's
tenants cannot fill it or a tenant's share outgrows a shard; sticky routing needs the counter
exchange."""

import pytest

from pdq.bench.shard_sim import (STICKY, Outcome, TenantLoad, backlogged, fair_shares, mix, report, sharding_table,
                                 simulate, skew_table)

CAPACITY = 2000.0  # the simulation's tokens per tick per shard


@pytest.fixture(scope="module")
def rows() -> list[Outcome]:
    return sharding_table()


@pytest.fixture(scope="module")
def skewed() -> list[tuple[str, Outcome]]:
    return skew_table()


@pytest.fixture
def table(rows) -> dict[tuple[int, str], Outcome]:
    return {(o.shards, o.placement): o for o in rows}


@pytest.fixture
def skew(skewed) -> dict[tuple[int, str], Outcome]:
    return {(o.shards, label): o for label, o in skewed}


def test_fair_shares_give_light_tenants_their_demand_and_split_the_rest_by_weight():
    tenants = [TenantLoad("light", 1, 100), TenantLoad("a", 1, 5000), TenantLoad("b", 3, 5000)]
    assert fair_shares(tenants, 1000) == pytest.approx({"light": 100, "a": 225, "b": 675})
    assert fair_shares([TenantLoad("x", 1, 10)], 1000) == {"x": 10}


def test_one_queue_with_all_the_capacity_serves_each_tenant_its_fair_share(table):
    for s in (1, 2, 4, 8):
        assert table[s, "one"].max_error < 0.015
        assert table[s, "one"].utilization > 0.99


def test_requests_spread_over_shards_keep_fair_share_and_throughput_grows_with_the_shards(table):
    base = table[1, "one"].throughput
    for s in (2, 4, 8):
        spread = table[s, "spread"]
        assert spread.max_error < 0.05 and spread.jain > 0.999
        assert spread.throughput >= 0.99 * s * base


def test_pinning_by_hash_leaves_shards_idle_while_other_tenants_wait(table):
    for s in (4, 8):
        pinned = table[s, "pinned-hash"]
        assert pinned.utilization < 0.8 and pinned.max_error > 0.5


def test_a_balanced_pinning_holds_until_one_tenants_share_outgrows_a_shard(table):
    assert table[4, "pinned-balanced"].max_error < 0.15
    assert table[4, "pinned-balanced"].utilization > 0.99
    eight = table[8, "pinned-balanced"]
    assert eight.fair["t03"] > 1.9 * CAPACITY  # its fair share: two shards' worth
    assert eight.got["t03"] <= CAPACITY  # pinned, it gets one shard at most
    assert eight.utilization < 0.95


def test_tenants_stuck_to_one_shard_get_their_share_only_with_the_counter_exchange(skew):
    for s in (2, 4):
        alone = skew[s, "per-shard counters"]
        assert all(alone.got[t] < 0.55 * alone.fair[t] for t in STICKY)
        assert skew[s, "exchange every 10 ticks"].max_error < 0.05
    assert skew[4, "exchange every 100 ticks"].max_error > skew[4, "exchange every 10 ticks"].max_error


def test_the_simulation_is_deterministic_per_seed():
    tenants = backlogged(2)
    assert simulate(tenants, "spread", 2, ticks=120, warmup=20) == simulate(tenants, "spread", 2, ticks=120, warmup=20)
    assert (simulate(mix(2), "spread", 2, ticks=120, warmup=20, seed=2).got
            != simulate(mix(2), "spread", 2, ticks=120, warmup=20, seed=3).got)


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="unknown placement 'random'"):
        simulate(mix(2), "random", 2, ticks=1)


def test_the_report_has_a_row_per_run_with_throughput_against_one_shard(rows, skewed):
    out = report(rows, skewed)
    assert out.count("| shards | placement |") == 2
    assert out.count("\n| ") == len(rows) + len(skewed) + 1
    assert "| 1 | one | " in out and "| 2,000 | 1.00x | 100% |" in out
    assert "| 4 | sticky + exchange every 10 ticks | " in out and "| 8,000 | 4.00x | 100% |" in out
