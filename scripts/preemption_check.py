"""64 long-prompt requests against an 8,192-token KV budget: every one completes, greedy output
unchanged. Prints one JSON line.

    .venv/bin/python scripts/preemption_check.py [--separate]

The reference is the in-process engine with a budget that never runs out (65,536 tokens). Then
the same requests through the engine at 8,192 tokens (it preempts by recompute) and through a
`pdq up` cluster whose worker has `--kv-budget-tokens 8192` (its decode worker reserves a
request's blocks before the prefill, so requests wait for room instead)."""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pdq.bench.workload import build
from pdq.client import Client
from pdq.engine import LLMEngine, SamplingParams
from pdq.model.builtin import ensure_builtin
from pdq.ops.up import Cluster

BUDGET = 8192
w = build("long-prompt", list(range(3, 4096)), n=64, seed=0)
prompts = [list(r.prompt_token_ids) for r in w.requests]
limits = [r.max_tokens for r in w.requests]
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in limits]
path = str(ensure_builtin("small"))
out = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "longest_prompt": max(map(len, prompts))}

ref = LLMEngine.from_pretrained(path, kv_budget_tokens=65536, max_seq_len=2048).generate(prompts, params)
small = LLMEngine.from_pretrained(path, kv_budget_tokens=BUDGET, max_seq_len=2048)
t = time.perf_counter()
got = small.generate(prompts, params)
out["engine"] = {"same_as_reference": got == ref, "preemptions": small.preemptions,
                 "seconds": round(time.perf_counter() - t, 1)}

cluster = Cluster(colocate="--separate" not in sys.argv, port=0,
                  extra_env={"PDQ_KV_BUDGET_TOKENS": str(BUDGET)}).start()
try:
    with Client(cluster.target) as client, ThreadPoolExecutor(len(prompts)) as pool:
        t = time.perf_counter()
        results = list(pool.map(lambda i: client.generate(prompts[i], max_tokens=limits[i], temperature=0.0,
                                                          ignore_eos=True, timeout=600), range(len(prompts))))
        out["service"] = {"mode": "colocated" if cluster.colocate else "separate",
                          "completed": sum(r.finish_reason == "length" for r in results),
                          "same_as_reference": [r.token_ids for r in results] == ref,
                          "seconds": round(time.perf_counter() - t, 1)}
finally:
    cluster.stop()
print(json.dumps(out))
