"""The in-process engine on a bench workload (32 requests at once, greedy), timed: one JSON line.

    .venv/bin/python scripts/engine_ab.py LABEL [WORKLOAD] [on|off]     # on/off: the prefix cache
    PYTHONPATH=/path/to/other/checkout .venv/bin/python scripts/engine_ab.py other   # another tree's engine

Run alternately against two trees (or cache on/off) to compare them side by side."""
import sys, time, json
import torch
import pdq
from pdq.bench.workload import build
from pdq.model.builtin import ensure_builtin
from pdq.model.tokenizer import load_tokenizer
from pdq.engine import LLMEngine, SamplingParams
path = ensure_builtin("small")
vocab = list(range(3, 256))
w = build(sys.argv[2] if len(sys.argv) > 2 else "mixed", vocab, n=32, seed=0)
kw = {} if len(sys.argv) < 4 else {"prefix_cache": sys.argv[3] == "on"}
e = LLMEngine.from_pretrained(str(path), kv_budget_tokens=65536, max_seq_len=2048, **kw)
e.runner.warm_up(e.policy.max_batched_tokens, e.policy.prefill_chunk)
prompts = [list(r.prompt_token_ids) for r in w.requests]
params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in w.requests]
e.generate(prompts[:2], params[:2])
t = time.perf_counter()
outs = e.generate(prompts, params)
dt = time.perf_counter() - t
n = sum(len(o) for o in outs)
print(json.dumps({"tree": sys.argv[1], "tok_s": round(n / dt, 1), "s": round(dt, 3), "tokens": n, "file": pdq.__file__}))
