"""The fault-free reference: each prompt's greedy output (ignore_eos), from the model in this
process (no RPC, no hand-off, no fault): the in-process engine, all prompts in one batch, whose
greedy output is each prompt's output alone (tests/engine check that against transformers'
`generate()`; run one by one, the 5,120 tokens of the short run's reference took ~28 s on a 2-core
machine, mostly the engine's per-step overhead, and ~3 s batched). A greedy output of n tokens is
the first n of a longer one, so each prompt runs once, to the longest max_tokens asked of it.

Computed once per model, prompts and lengths, and kept in the model cache ($PDQ_CACHE_DIR/chaos):
on a busy machine it takes longer than the short run itself."""

import hashlib
import json
import os
import tempfile
from pathlib import Path

# The reference's dtype, which the cluster's roles run too (`pdq.chaos.cluster.ROLE_ENV`): the
# garbled check compares each request's greedy tokens with the reference's, and a bfloat16 model's
# are not float32's (bfloat16, the workers' default on a CPU with AMX or AVX512_BF16, failed it for
# thousands of requests).
DTYPE = "float32"


def greedy_reference(model_dir: str, prompts: tuple[str, ...], longest: list[int]) -> list[list[int]]:
    """-> per prompt, its first longest[i] greedy tokens (the gateway's tokenization: no special tokens)."""
    path = _cache_path(model_dir, prompts, longest)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = _compute(model_dir, prompts, longest)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".reference-")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    return out


def _compute(model_dir: str, prompts: tuple[str, ...], longest: list[int]) -> list[list[int]]:
    import torch

    from pdq.engine import LLMEngine, SamplingParams
    from pdq.model.tokenizer import load_tokenizer

    # one thread: the tiny model's steps are too small to share, and on a busy machine more threads
    # would spin for cores that others hold and wait for each other at every parallel region
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    wanted = [(i, tokenizer.encode(text, add_special_tokens=False).ids, n)
              for i, (text, n) in enumerate(zip(prompts, longest)) if n > 0]
    budget = sum(len(ids) + n for _, ids, n in wanted) + 16 * len(wanted)  # every sequence at once, a block spare each
    engine = LLMEngine.from_pretrained(model_dir, kv_budget_tokens=max(4096, budget), max_seq_len=512,
                                       dtype=getattr(torch, DTYPE))
    outs = engine.generate([ids for _, ids, _ in wanted],
                           [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, _, n in wanted])
    out: list[list[int]] = [[] for _ in prompts]
    for (i, _, _), tokens in zip(wanted, outs):
        out[i] = tokens
    return out


def _cache_path(model_dir: str, prompts: tuple[str, ...], longest: list[int]) -> Path:
    """Keyed by the model's files (name, size, mtime), the prompts, the lengths and the dtype."""
    from pdq.model.builtin import default_cache_dir

    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    key = json.dumps([str(Path(model_dir).resolve()), files, list(prompts), longest, DTYPE])
    return default_cache_dir() / "chaos" / f"reference-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
