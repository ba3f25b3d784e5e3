"""How many mixed-workload sequences one decode worker runs at once in a 16,384-token KV budget:
64 `mixed` requests offered at once to a colocated `pdq up` cluster whose worker has
`--kv-budget-tokens 16384` (and 64 seats); the decode steps' batch sizes are read from its
`pdq_batch_size` histogram (stage "decode"). A pool of whole `--max-seq-len` (2,048) slots would
hold 16,384 / 2,048 = 8 sequences. Writes the result JSON.

    .venv/bin/python scripts/kv_concurrency.py --json benchmarks/cpu/kv-concurrency.json
"""
import argparse
import json
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pdq.bench.workload import build
from pdq.client import Client
from pdq.ops.up import Cluster

BUDGET, SEATS, MAX_SEQ_LEN = 16384, 64, 2048
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def steps_above(url: str) -> dict[int, int]:
    """Decode steps so far that ran more than n sequences, for each bucket bound n (the worker's
    `pdq_batch_size` histogram, stage "decode")."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {(s.name, s.labels.get("le", "")): s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.labels.get("stage") == "decode" and s.name.startswith("pdq_batch_size")}
    total = samples[("pdq_batch_size_count", "")]
    return {n: int(total - samples[("pdq_batch_size_bucket", f"{float(n)}")]) for n in BUCKETS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="", help="write the result here")
    args = parser.parse_args()
    w = build("mixed", list(range(3, 4096)), n=64, seed=0)
    env = {"PDQ_KV_BUDGET_TOKENS": str(BUDGET), "PDQ_MAX_BATCH_SIZE": str(SEATS)}
    cluster = Cluster(colocate=True, port=0, extra_env=env).start()
    try:
        worker = next(c for c in cluster.children if c.name.startswith("decode-"))
        before = steps_above(worker.metrics_url(cluster.host))
        with Client(cluster.target) as client, ThreadPoolExecutor(len(w.requests)) as pool:
            started = time.perf_counter()
            results = list(pool.map(lambda r: client.generate(list(r.prompt_token_ids), max_tokens=r.max_tokens,
                                                              ignore_eos=True, timeout=600), w.requests))
            seconds = time.perf_counter() - started
        after = steps_above(worker.metrics_url(cluster.host))
    finally:
        cluster.stop()
    above = {n: after[n] - before[n] for n in BUCKETS}
    most = max((n for n, k in above.items() if k > 0), default=0)  # some step ran more than this many
    tokens = [len(r.prompt_token_ids) + r.max_tokens for r in w.requests]
    out = {"command": "python scripts/kv_concurrency.py" + (f" --json {args.json}" if args.json else ""),
           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_1m": os.getloadavg()[0]},
           "kv_budget_tokens": BUDGET, "seats": SEATS, "max_seq_len": MAX_SEQ_LEN,
           "slot_pool_sequences": BUDGET // MAX_SEQ_LEN, "requests": len(results),
           "completed": sum(r.finish_reason == "length" for r in results),
           "mean_sequence_tokens": round(sum(tokens) / len(tokens), 1), "seconds": round(seconds, 1),
           "decode_steps_above": above, "most_at_once_above": most,
           "vs_slot_pool": most / (BUDGET // MAX_SEQ_LEN)}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
