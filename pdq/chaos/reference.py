"""The fault-free reference: each prompt's greedy output (ignore_eos), from the model in this
process, the prompt alone (no batch, no RPC, no hand-off). A greedy output of n tokens is the
first n of a longer one, so each prompt runs once, to the longest max_tokens asked of it.

Computed once per model, prompts and lengths, and kept in the model cache ($PDQ_CACHE_DIR/chaos):
on a busy machine it takes longer than the short run itself."""

import hashlib
import json
import os
import tempfile
from pathlib import Path


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

    # one thread: a prompt alone is too small to share, and on a busy machine more threads
    # would spin for cores that others hold and wait for each other at every parallel region
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(model_dir)
    engine = LLMEngine.from_pretrained(model_dir, kv_budget_tokens=4096, max_seq_len=512)
    out = []
    for text, n in zip(prompts, longest):
        if n <= 0:
            out.append([])
            continue
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        out.append(engine.generate([ids], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0])
    return out


def _cache_path(model_dir: str, prompts: tuple[str, ...], longest: list[int]) -> Path:
    """Keyed by the model's files (name, size, mtime), the prompts and the lengths."""
    from pdq.model.builtin import default_cache_dir

    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    key = json.dumps([str(Path(model_dir).resolve()), files, list(prompts), longest])
    return default_cache_dir() / "chaos" / f"reference-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
