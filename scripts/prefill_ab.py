"""One prefill pass of the `mixed` workload's 32 prompts (3,791 tokens), attention one call per
prompt vs one masked call for all (`ModelRunner.batched_prefill_rows`), alternating: one JSON line.

    python scripts/prefill_ab.py [MODEL] [ROUNDS]      # MODEL: builtin:1b (default), a checkpoint dir

The batched call is what a GPU runs by default; on a CPU the runner makes a call per prompt."""
import json
import statistics
import sys
import time

import torch

from pdq.bench.workload import build, vocabulary
from pdq.engine import ModelRunner, PrefillItem
from pdq.model.loader import resolve_model

path = str(resolve_model(sys.argv[1] if len(sys.argv) > 1 else "builtin:1b"))
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
prompts = [list(r.prompt_token_ids) for r in build("mixed", vocabulary(path), n=32, seed=0).requests]
runner = ModelRunner.from_pretrained(path, kv_budget_tokens=65536, max_seq_len=2048, prefix_cache=False)
batched_rows = runner.batched_prefill_rows or 8192


def sync() -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize()


def one_pass(rows: int) -> float:
    runner.batched_prefill_rows = rows
    for i, p in enumerate(prompts):
        runner.allocate(i, p)
    sync()
    t = time.perf_counter()
    runner.prefill([PrefillItem(i, p, 0) for i, p in enumerate(prompts)])
    sync()
    dt = time.perf_counter() - t
    for i in range(len(prompts)):
        runner.free(i)
    return dt


one_pass(0), one_pass(batched_rows)  # warm both
times = {"per_prompt": [], "batched": []}
for _ in range(rounds):
    times["per_prompt"].append(one_pass(0))
    times["batched"].append(one_pass(batched_rows))
print(json.dumps({"device": str(runner.device), "dtype": str(runner.dtype), "tokens": sum(map(len, prompts)),
                  **{f"{k}_ms": round(1000 * statistics.median(v), 2) for k, v in times.items()}}))
