"""Prefix-aware routing against load-only placement: `python -m pdq.bench.prefix_routing`.

Spawns the same cluster twice per repeat (as `pdq bench --spawn`: `--decode` colocated workers
by default), once with the scheduler's `--prefix-routing` and once without, in alternating order,
offers both the same requests, and reports each one's TTFT and prefix-cache hit rate.

The workload is `shared-prefix` with `--groups` system prompts instead of one: each request
opens with one of them, drawn at random, then a short part of its own (chat sessions of
several applications or users). With one system prompt every worker soon holds it and placement
cannot matter; with several, load-only placement spreads every group over every worker, so each
worker computes (and caches) every group's prompt, while routing keeps a group where its prompt
is, and a worker's cache (`--env PDQ_KV_BUDGET_TOKENS=...`) need hold only its share.
Every `pdq bench` flag applies (`--rate`, `--requests`, `--repeat`, `--json`, `--env`, ...).
"""

import argparse
import random
import statistics
import sys
from dataclasses import replace

from pdq.bench import report
from pdq.bench.command import Bench, config_json, run_dtype, say
from pdq.bench.options import BenchOptions, add_arguments
from pdq.bench.workload import SHARED_PREFIX_TOKENS, BenchRequest, Workload, vocabulary

SYSTEMS = (("load-only", "false"), ("prefix-routed", "true"))


def grouped(vocab: list[int], n: int, groups: int, seed: int, max_model_len: int) -> Workload:
    """`n` requests, each opening with one of `groups` system prompts (drawn at random) and then
    16..96 tokens of its own; 16..64 output tokens."""
    rng = random.Random(f"pdq-bench/prefix-routing/{groups}/{seed}")
    size = min(SHARED_PREFIX_TOKENS, max_model_len - 256)
    systems = [tuple(rng.choice(vocab) for _ in range(size)) for _ in range(groups)]
    reqs = []
    for i in range(n):
        g = rng.randrange(groups)
        own = tuple(rng.choice(vocab) for _ in range(rng.randint(16, 96)))
        reqs.append(BenchRequest(i, systems[g] + own, rng.randint(16, 64), kind=f"group-{g}"))
    return Workload(f"shared-prefix/{groups}", seed, tuple(reqs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdq.bench.prefix_routing", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.add_argument("--groups", type=int, default=8, help="system prompts the requests share (default 8)")
    p.set_defaults(spawn=True, decode=2, strategies="continuous", no_roofline=True)
    args = p.parse_args(argv)
    try:
        opts = BenchOptions.from_args(args)
        if args.groups < 1:
            raise ValueError("--groups must be >= 1")
        from pdq.model.loader import resolve_model

        model_dir = str(resolve_model(opts.model))
        vocab = vocabulary(model_dir)
        workload = grouped(vocab, opts.requests or 64, args.groups, opts.seed, opts.max_model_len)
    except ValueError as exc:
        say(f"prefix routing bench: {exc}")
        return 2
    say(f"prefix routing bench: {len(workload.requests)} requests over {args.groups} system prompts, "
        f"{opts.decode} decode workers ({'colocated' if opts.colocate else 'separate'})")
    runs = []
    for repeat in range(opts.repeat):
        for label, routing in SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]:
            bench = Bench(replace(opts, env={**opts.env, "PDQ_PREFIX_ROUTING": routing}), workload, vocab)
            bench.repeat = repeat
            for strategy in opts.strategies:
                bench.spawned(strategy)
            for entry in bench.runs:
                entry["name"] = label if len(opts.strategies) == 1 else f"{label}/{entry['name']}"
            runs += bench.runs
    med = report.median_repeats(runs)
    print(report.table(runs if opts.repeat > 1 else med))
    print()
    print(report.prefix_lines(runs))
    summary = summarize(runs)
    print()
    for name, row in summary.items():
        carried = f", hand-offs carried {row['handoff_mb']:,.1f} MB" if row["handoff_mb"] else ""
        print(f"{name}: TTFT p50 {row['ttft_p50_ms']:,.0f} ms, prefix cache hit rate {row['hit_rate']:.2f}{carried} "
              f"(medians of {row['repeats']} repeat(s))")
    if len(summary) == 2:
        off, on = summary["load-only"], summary["prefix-routed"]
        print(f"prefix routing: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x better, "
              f"hit rate {off['hit_rate']:.2f} -> {on['hit_rate']:.2f}")
    if opts.json:
        doc = report.document(med, {**config_json(opts, model_dir, workload, run_dtype(opts.dtype)),
                                    "groups": args.groups},
                              sys.argv if argv is None else argv)
        doc["command"] = " ".join(["python -m pdq.bench.prefix_routing", *(sys.argv[1:] if argv is None else argv)])
        doc["prefix_routing"] = summary
        if opts.repeat > 1:
            doc["all_runs"] = runs
        report.write_json(opts.json, doc)
        say(f"prefix routing bench: wrote {opts.json}")
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per system, the medians over its repeats of: TTFT p50 (ms), the share of looked-up prompt
    tokens found cached, and (separate prefill and decode workers) the MB of K/V hand-offs
    carried; and each repeat's values."""
    by: dict[str, list[tuple[float, float, float]]] = {}
    for r in runs:
        cache = r.get("prefix_cache") or {}
        hit = cache.get("hit_tokens", 0) / max(1, cache.get("queried_tokens", 0))
        by.setdefault(r["name"], []).append((r["ttft_ms"]["p50"], round(hit, 3),
                                             round(cache.get("handoff_bytes", 0) / 1e6, 1)))
    return {name: {"ttft_p50_ms": statistics.median(t for t, _, _ in rows),
                   "hit_rate": statistics.median(h for _, h, _ in rows),
                   "handoff_mb": statistics.median(m for _, _, m in rows),
                   "repeats": len(rows),
                   "each": [{"ttft_p50_ms": t, "hit_rate": h, "handoff_mb": m} for t, h, m in rows]}
            for name, rows in by.items()}


if __name__ == "__main__":
    sys.exit(main())
