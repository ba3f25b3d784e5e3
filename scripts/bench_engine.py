"""Benchmark the model runtime on a small random Llama (hidden 512, 8 layers, 8 heads / 4 KV
heads, intermediate 1408, vocab 4096: the shape of the built-in "small" model).

Prints:
  (a) one decode step's time at batch 1/8/32 with ~200 tokens of context;
  (b) LLMEngine throughput (output tokens/s) on the "mixed" workload: 32 requests, prompt
      lengths uniform 16..256, output lengths uniform 8..128 (seed 0), ignore_eos, all at once;
  (c) HF `generate()` on the same requests in static batches of 8, left padded, greedy
      (useful output tokens/s: only each request's requested tokens count).

    .venv/bin/python scripts/bench_engine.py [--parts abc] [--repeat N] [--max-batched-tokens N] [--prefill-chunk N]
"""

import argparse
import os
import random
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pdq.engine import LLMEngine, ModelRunner, PrefillItem, SamplingParams

MAX_SEQ_LEN = 512


def small_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.05,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def mixed_workload(n=32, seed=0, vocab=4096) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    out_lens = [rng.randint(8, 128) for _ in range(n)]
    return prompts, out_lens


def bench_decode_step(runner: ModelRunner, batch: int, context: int = 200, steps: int = 20) -> tuple[float, float]:
    """(median, min) ms of one decode step for `batch` sequences with `context` tokens of KV."""
    g = torch.Generator().manual_seed(batch)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for s in ids:
        runner.allocate(s)
    for s in ids:  # prefill one at a time: prefill cost is not measured here
        runner.prefill([PrefillItem(s, torch.randint(0, runner.vocab_size, (context,), generator=g).tolist(), 0)])
    times = []
    for step in range(steps + 3):
        items = [(s, (7 * step + i) % runner.vocab_size, context + step) for i, s in enumerate(ids)]
        t = time.perf_counter()
        runner.decode(items).argmax(-1).tolist()
        times.append(time.perf_counter() - t)
    for s in ids:
        runner.free(s)
    return statistics.median(times[3:]) * 1e3, min(times[3:]) * 1e3


def bench_engine(engine: LLMEngine, prompts, out_lens) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in out_lens]
    engine.generate([p[:16] for p in prompts[:4]], params[:4])  # warm-up
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t
    assert [len(o) for o in outs] == out_lens
    return dt, sum(out_lens)


@torch.inference_mode()
def bench_hf(model, prompts, out_lens, batch=8) -> tuple[float, int]:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, ns = prompts[i : i + batch], out_lens[i : i + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        n = max(ns)
        model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    return time.perf_counter() - t, sum(out_lens)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-batched-tokens", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--parts", default="abc", help="which of (a), (b), (c) to run, e.g. 'ab'")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of (b) and (c), alternating; best is kept")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")

    hf = small_llama()
    runner = ModelRunner(hf, kv_budget_tokens=32 * MAX_SEQ_LEN, max_seq_len=MAX_SEQ_LEN)
    print(f"device {runner.device}, dtype {runner.dtype}, KV slots {runner.capacity} x {MAX_SEQ_LEN} tokens")

    if "a" in args.parts:
        print("(a) decode step, ~200 tokens of context")
        for b in (1, 8, 32):
            med, best = bench_decode_step(runner, b)
            print(f"    batch {b:2d}: {med:7.2f} ms (median), {best:7.2f} ms (min)")

    prompts, out_lens = mixed_workload()
    engine = LLMEngine(runner, max_batched_tokens=args.max_batched_tokens, prefill_chunk=args.prefill_chunk)
    n = sum(out_lens)
    eng_s = hf_s = float("inf")
    for _ in range(args.repeat):
        if "b" in args.parts:
            eng_s = min(eng_s, bench_engine(engine, prompts, out_lens)[0])
            assert runner.num_free == runner.capacity, "KV slots leaked"
        if "c" in args.parts:
            hf_s = min(hf_s, bench_hf(hf, prompts, out_lens)[0])
    if "b" in args.parts:
        print(
            f"(b) LLMEngine mixed workload: {n} output tokens in {eng_s:.2f} s = {n / eng_s:.0f} tok/s "
            f"(max_batched_tokens={args.max_batched_tokens}, prefill_chunk={args.prefill_chunk})"
        )
    if "c" in args.parts:
        print(f"(c) HF generate, static batches of 8: {n} useful tokens in {hf_s:.2f} s = {n / hf_s:.0f} tok/s")
    if "b" in args.parts and "c" in args.parts:
        print(f"    engine / HF = {hf_s / eng_s:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} (other processes on this machine skew the numbers)")


if __name__ == "__main__":
    main()
