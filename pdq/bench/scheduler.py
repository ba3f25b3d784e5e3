"""Measure the scheduler's goals (issue 4) on a real local cluster.

Starts a cluster (private Redis, 1 prefill + 1 decode worker, two client tenants "heavy" and
"light" of equal weight), then measures:
  fairness   heavy queues 10x light's requests (queued while dispatch is paused, then resumed); while
             both are backlogged, each tenant's share of the tokens dispatched (prompt + output) and
             of the output tokens streamed;
  ttft       light's p99 TTFT (one request at a time) alone, then while heavy floods the cluster;
  cancel     Cancel RPC -> terminal for a queued request; Cancel RPC -> KV slot free (the decode
             worker's registry entry) for a decoding one;
  deadline   how far past its deadline a request ends (record finished_ms - deadline_ms), for
             requests that time out queued and while decoding.

    .venv/bin/pdq bench --scheduler [--model builtin:tiny] [--requests 200] [--env K=V] [--json FILE]

(8 decode slots; --requests: light requests per measurement, default 200, heavy queues 10x that.
A p99 needs the samples: of 50 it is the highest, here always the light request sent as the
flood starts; of 200 it is the third highest. About 2 minutes a run.)
"""

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc
import redis

from pdq.bench.report import machine
from pdq.bench.options import dtype_env
from pdq.ops import cpu
from pdq.client import Client
from pdq.ops.up import Cluster

KEYS = {"heavy": "bench-key-heavy-0001", "light": "bench-key-light-0002"}


DEFAULT_SAMPLES = 200  # light requests per measurement: enough for the p99 to be one


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


def wait(predicate, timeout_s: float = 120.0, every_s: float = 0.002):
    deadline = time.monotonic() + timeout_s
    while not (got := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(getattr(predicate, "__name__", "condition"))
        time.sleep(every_s)
    return got


class Bench:
    def __init__(self, cluster: Cluster, slots: int):
        self.cluster = cluster
        self.slots = slots
        self.r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        self.heavy = Client(cluster.target, api_key=KEYS["heavy"])
        self.light = Client(cluster.target, api_key=KEYS["light"])

    def state(self, rid: str) -> str:
        return self.r.hget(f"pdq:req:{rid}", "state") or ""

    def field(self, rid: str, name: str) -> int:
        return int(self.r.hget(f"pdq:req:{rid}", name) or 0)

    def token_times(self, rid: str) -> list[int]:
        return [int(i.split("-")[0]) for i, f in self.r.xrange(f"pdq:req:{rid}:out") if "i" in f
                for _ in f["t"].split(",")]  # an entry's tokens were written at once

    def idle(self) -> None:
        wait(lambda: int(self.r.hget("pdq:load", "n") or 0) == 0 and all(
            int(h.get("free_slots", 0)) == int(h.get("capacity", -1))
            for w in self.r.zrange("pdq:workers:decode", 0, -1) if (h := self.r.hgetall(f"pdq:worker:{w}"))))

    def fairness(self, n: int) -> dict:
        prompt, out = [7] * 32, 32
        self.r.sadd("pdq:paused", "tier:interactive")  # queue everything first: both backlogged from the start
        heavy = [self.heavy.submit(prompt, max_tokens=out, ignore_eos=True) for _ in range(10 * n)]
        light = [self.light.submit(prompt, max_tokens=out, ignore_eos=True) for _ in range(n)]
        start = int(self.r.time()[0] * 1000 + self.r.time()[1] // 1000)
        self.r.srem("pdq:paused", "tier:interactive")
        wait(lambda: all(self.state(x) == "COMPLETED" for x in light), 600)
        end = max(self.field(x, "dispatched_ms") for x in light)  # light backlogged until then
        tokens = {"heavy": 0, "light": 0}
        for tenant, rids in (("heavy", heavy), ("light", light)):
            for x in rids:
                if start <= self.field(x, "dispatched_ms") <= end:
                    tokens[tenant] += len(prompt) + out
        # output tokens streamed from the start to light's last token
        out_start, out_end = start, max(max(self.token_times(x)) for x in light)
        streamed = {t: sum(sum(1 for ts in self.token_times(x) if out_start <= ts <= out_end) for x in rids)
                    for t, rids in (("heavy", heavy), ("light", light))}
        for x in heavy:
            self.heavy.cancel(x)
        self.idle()
        total, total_out = sum(tokens.values()), sum(streamed.values())
        return {"dispatched_share_light": round(tokens["light"] / total, 3),
                "streamed_share_light": round(streamed["light"] / total_out, 3),
                "heavy_requests": len(heavy), "light_requests": len(light)}

    def ttft_light(self, n: int) -> tuple[list[float], dict]:
        """-> client TTFTs (ms), and the median split of the server's part: queue, prefill."""
        out, queue, prefill, hops = [], [], [], []
        for i in range(n):
            t0 = time.perf_counter()
            stream = self.light.generate_stream([9, 10 + i % 50] * 16, max_tokens=8, ignore_eos=True)
            rid = next(stream).request_id
            for msg in stream:
                if msg.HasField("index"):
                    out.append(1000 * (time.perf_counter() - t0))
                    break
            stream.close()
            created, dispatched, first = (self.field(rid, f) for f in ("created_ms", "dispatched_ms", "first_token_ms"))
            queue.append(dispatched - created)
            prefill.append(first - dispatched)
            hops.append(out[-1] - (first - created))  # client -> gateway -> Redis record, first token -> client
            time.sleep(0.05)
        return out, {"queue_ms_median": statistics.median(queue), "queue_ms_p99": p99(queue),
                     "prefill_ms_median": statistics.median(prefill), "prefill_ms_p99": p99(prefill),
                     "client_hops_ms_median": round(statistics.median(hops), 1), "client_hops_ms_p99": round(p99(hops), 1),
                     "samples": {"ttft_ms": [round(x, 1) for x in out], "queue_ms": queue, "prefill_ms": prefill}}

    def flood(self, stop: threading.Event) -> list[threading.Thread]:
        """Heavy keeps 3x the decode slots busy or queued until `stop` (outputs of 16..80 tokens)."""
        def loop(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                try:
                    self.heavy.generate([7] * 32, max_tokens=rng.randint(16, 80), ignore_eos=True)
                except grpc.RpcError:
                    time.sleep(0.05)
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(3 * self.slots)]
        for t in threads:
            t.start()
        return threads

    def cancels(self, n: int) -> dict:
        queued, freed = [], []
        stop = threading.Event()
        threads = self.flood(stop)
        wait(lambda: int(self.r.hget("pdq:load", "n") or 0) > 0)
        for _ in range(n):
            rid = self.light.submit([5] * 16, max_tokens=8)
            if self.state(rid) != "QUEUED":
                continue
            t0 = time.perf_counter()
            self.light.cancel(rid)  # returns once the terminal state is written
            assert self.state(rid) == "CANCELLED"
            queued.append(1000 * (time.perf_counter() - t0))
        stop.set()
        for t in threads:
            t.join()
        self.idle()
        for _ in range(n):
            rid = self.light.submit([5] * 16, max_tokens=1500, ignore_eos=True)
            wait(lambda: self.state(rid) == "DECODING" and self.field(rid, "n_out") > 2)
            worker = next(w for w in self.r.zrange("pdq:workers:decode", 0, -1)
                          if self.r.hget(f"pdq:worker:{w}", "address") == self.r.hget(f"pdq:req:{rid}", "decode_worker"))
            t0 = time.perf_counter()
            self.light.cancel(rid)
            wait(lambda: self.r.hget(f"pdq:worker:{worker}", "free_slots") == self.r.hget(f"pdq:worker:{worker}", "capacity"))
            freed.append(1000 * (time.perf_counter() - t0))
        return {"queued_cancel_ms_p99": round(p99(queued), 1), "queued_cancel_ms_median": round(statistics.median(queued), 1),
                "decoding_cancel_to_kv_free_ms_p99": round(p99(freed), 1),
                "decoding_cancel_to_kv_free_ms_median": round(statistics.median(freed), 1), "samples": len(freed)}

    def deadlines(self, n: int) -> dict:
        over_queued, over_running = [], []
        stop = threading.Event()
        threads = self.flood(stop)
        wait(lambda: int(self.r.hget("pdq:load", "n") or 0) > 0)
        rids = [self.light.submit([5] * 16, max_tokens=8, timeout_ms=20 + 5 * i) for i in range(n)]
        for rid in rids:
            wait(lambda: self.state(rid) in ("TIMED_OUT", "COMPLETED"))
            if self.state(rid) == "TIMED_OUT" and not self.field(rid, "dispatched_ms"):
                over_queued.append(self.field(rid, "finished_ms") - self.field(rid, "deadline_ms"))
        stop.set()
        for t in threads:
            t.join()
        self.idle()
        rids = [self.light.submit([5] * 16, max_tokens=1500, ignore_eos=True, timeout_ms=500 + 20 * i) for i in range(n)]
        for rid in rids:
            wait(lambda: self.state(rid) in ("TIMED_OUT", "COMPLETED"))
            if self.state(rid) == "TIMED_OUT" and self.field(rid, "n_out") > 0:
                over_running.append(self.field(rid, "finished_ms") - self.field(rid, "deadline_ms"))
        self.idle()
        return {"queued_overshoot_ms_p99": p99(over_queued), "running_overshoot_ms_p99": p99(over_running),
                "samples": [len(over_queued), len(over_running)]}


GOALS = (  # (name, value in the report, limit, what it measures): issue 4's goals
    ("light tenant's share of tokens dispatched", ("fairness", "dispatched_share_light"), (0.4, 0.6)),
    ("light p99 TTFT flooded / alone", ("ttft_light", "ratio"), (0, 2.0)),
    ("cancel of a queued request, p99 ms", ("cancel", "queued_cancel_ms_p99"), (0, 150)),
    ("cancel of a decoding request to KV free, p99 ms", ("cancel", "decoding_cancel_to_kv_free_ms_p99"), (0, 400)),
    ("deadline overshoot queued, p99 ms", ("deadline", "queued_overshoot_ms_p99"), (0, 250)),
    ("deadline overshoot decoding, p99 ms", ("deadline", "running_overshoot_ms_p99"), (0, 250)),
)


def measure(model: str, slots: int, n: int, extra_env: dict, colocate: bool = False,
            control_policy: str = "batch", client_policy: str = "batch") -> dict:
    """Runs every measurement on a cluster of its own, the clients' threads (the light tenant's
    and the flood's) under `client_policy` (pdq.ops.cpu). -> the report."""
    with tempfile.TemporaryDirectory() as tmp:
        auth = Path(tmp) / "keys.json"
        auth.write_text(json.dumps({"keys": [{"key": k, "tenant": t, "role": "client"} for t, k in KEYS.items()]}))
        env = {**extra_env, "PDQ_AUTH_FILE": str(auth), "PDQ_MAX_BATCH_SIZE": str(slots)}
        with (Cluster(model=model, port=0, auth=False, metrics_port=-1, colocate=colocate, control_policy=control_policy,
                      extra_env=env) as cluster, cpu.policy(client_policy)):
            bench = Bench(cluster, slots)
            report = {"fairness": bench.fairness(n)}
            alone, alone_split = bench.ttft_light(n)
            stop = threading.Event()
            threads = bench.flood(stop)
            wait(lambda: int(bench.r.hget("pdq:load", "n") or 0) > 0)
            flooded, flooded_split = bench.ttft_light(n)
            stop.set()
            for t in threads:
                t.join()
            bench.idle()
            report["ttft_light"] = {"alone_p99_ms": round(p99(alone), 1), "flooded_p99_ms": round(p99(flooded), 1),
                                    "ratio": round(p99(flooded) / p99(alone), 2),
                                    "alone_split": alone_split, "flooded_split": flooded_split}
            report["cancel"] = bench.cancels(n)
            report["deadline"] = bench.deadlines(n)
    return report


def run(args: argparse.Namespace) -> int:
    """`pdq bench --scheduler`: prints the report and each goal, met or not; --json writes it."""
    env = dict(kv.split("=", 1) for kv in args.env)
    env.update(dtype_env(args))
    n = args.requests or DEFAULT_SAMPLES
    report = measure(args.model, 8, n, env, args.colocate, args.control_policy, args.client_policy)
    print(json.dumps(report, indent=2))
    for name, (part, key), (low, high) in GOALS:
        value = report[part][key]
        print(f"  {name}: {value}   goal {low}..{high}: {'met' if low <= value <= high else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scheduler": report, "machine": machine()}, indent=2))
    return 0
