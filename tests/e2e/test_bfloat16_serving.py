"""Serving in bfloat16 end to end, colocated and with P/D separated: what workers run by default on
a CPU with AMX or AVX512_BF16 and on a GPU (the rest of the suite pins PDQ_DTYPE=float32). Real
processes, the `tiny` built-in model; every role registers bfloat16, and each request's greedy
tokens are the in-process engine's in bfloat16 (its pool, its decode attention kernel, its
hand-off of bfloat16 K/V). One request at a time, each alone in the engine too: the same shapes
on both sides, so the check holds on any CPU (a bfloat16 GEMM's rounding may depend on its rows)."""

import pytest
import redis
import torch

from pdq.client import Client
from pdq.engine import LLMEngine, SamplingParams
from pdq.model.loader import resolve_model
from pdq.ops.up import Cluster
from pdq.state.registry import ROLES, live_call
from pdq.state.store import SyncStore

PROMPTS = [[5 + (7 * i + 3 * k) % 200 for k in range(12 + 9 * i)] for i in range(6)]  # 12..57 tokens
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    engine = LLMEngine.from_pretrained(str(resolve_model("builtin:tiny")), kv_budget_tokens=4096, max_seq_len=512,
                                       dtype=torch.bfloat16, prefix_cache=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0] for p in PROMPTS]


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated", "separate"])
def test_a_bfloat16_cluster_streams_the_engines_bfloat16_greedy_tokens(colocate, reference):
    with Cluster(model="builtin:tiny", port=0, prefill=1, decode=1, colocate=colocate, auth=False,
                 extra_env={"PDQ_DTYPE": "bfloat16"}) as cluster:
        client = Client(cluster.target)
        got = [client.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120).token_ids for p in PROMPTS]
        r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        store = SyncStore(r)
        dtypes = {w.worker_id: w.kv_dtype for ws in store.run(live_call(store, ROLES, 60)).values() for w in ws}
        r.close()
    assert len(dtypes) == 2 and set(dtypes.values()) == {"bfloat16"}, dtypes  # both roles
    assert got == reference  # (3 of these 6 prompts' greedy tokens differ in float32)
