"""The request-level strategies give the same greedy tokens as continuous batching."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdq.client import Client
from pdq.up import Cluster
from tests.e2e.conftest import KEYS

PROMPTS = [("alpha", 5), ("a somewhat longer prompt " * 5, 17), ("x", 9), ("tail " * 40, 3), ("last one", 12)]


def run_all(target: str, api_key: str | None = None) -> list[list[int]]:
    with Client(target, api_key=api_key) as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: c.generate(p[0], max_tokens=p[1], ignore_eos=True).token_ids, PROMPTS))


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_request_level_strategies_match_continuous(cluster, strategy):
    expected = run_all(cluster.target, KEYS["acme"])
    env = {"PDQ_STRATEGY": strategy, "PDQ_STRATEGY_BATCH_SIZE": "3", "PDQ_STATIC_FLUSH_MS": "300"}
    with Cluster(model="builtin", port=0, extra_env=env) as other:
        assert run_all(other.target) == expected  # the client finds this cluster's dev key itself
    assert [len(t) for t in expected] == [n for _, n in PROMPTS]
