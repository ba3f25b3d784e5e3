"""The request-level strategies give the same greedy tokens as continuous batching."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from pdq.client import Client, OperatorClient
from pdq.ops.up import Cluster
from tests.e2e.conftest import KEYS

PROMPTS = [("alpha", 5), ("a somewhat longer prompt " * 5, 17), ("x", 9), ("tail " * 40, 3), ("last one", 12)]


def run_all(target: str, api_key: str | None = None) -> list:
    with Client(target, api_key=api_key) as c, ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: c.generate(p[0], max_tokens=p[1], ignore_eos=True), PROMPTS))


def most_at_once(spans: list[tuple[int, int]]) -> int:
    """The most [start, end) intervals that hold one instant."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_request_level_strategies_match_continuous(cluster, strategy):
    expected = [r.token_ids for r in run_all(cluster.target, KEYS["acme"])]
    env = {"PDQ_STRATEGY": strategy, "PDQ_STRATEGY_BATCH_SIZE": "3", "PDQ_STATIC_FLUSH_MS": "300"}
    with Cluster(model="builtin", port=0, extra_env=env) as other:
        results = run_all(other.target)  # the client finds this cluster's dev key itself
        with OperatorClient(other.target, api_key=other.admin_key) as op:
            infos = [op.get_request(r.request_id) for r in results]
    assert [r.token_ids for r in results] == expected
    assert [len(t) for t in expected] == [n for _, n in PROMPTS]
    # A request-level batch is taken whole and run to completion before the next is taken (as
    # naive servers do): never more than a batch's worth of requests past the queue at once.
    assert most_at_once([(i.dispatched_ms, i.finished_ms) for i in infos]) <= 3
    assert all(i.dispatched_ms and i.finished_ms for i in infos)
