"""The chaos cluster's roles run the reference's dtype, whatever the caller's environment says:
the garbled check compares each request's greedy tokens with an in-process float32 reference,
and bfloat16's (the workers' default on a CPU with AMX or AVX512_BF16) are not float32's."""

import asyncio

from pdq.chaos.cluster import ChaosCluster


def test_every_role_runs_float32_even_where_the_caller_asks_for_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setenv("PDQ_DTYPE", "bfloat16")
    cluster = ChaosCluster(tmp_path, "/nonexistent-model", clock=lambda: 0.0)
    try:
        assert {r.name: r.env["PDQ_DTYPE"] for r in cluster.roles} == {r.name: "float32" for r in cluster.roles}
        assert {r.name for r in cluster.roles} >= {"prefill-0", "decode-0", "gateway", "scheduler-0"}
    finally:
        asyncio.run(cluster.stop())
