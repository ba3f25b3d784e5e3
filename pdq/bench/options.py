"""`pdq bench` flags and their validated form. Importing this module stays light (no torch, no grpc)."""

import argparse
import math
import os
from dataclasses import dataclass, field

from pdq.bench.arrivals import Arrivals, parse_concurrency, parse_rates
from pdq.bench.workload import WORKLOADS
from pdq.ops import cpu
from pdq.config import DTYPE_NAMES, UP_COLOCATE_HELP, UP_SEPARATE_HELP, UP_CONTROL_POLICY_HELP
from pdq.state.request import MAX_STREAM_INTERVAL

STRATEGIES = ("static", "dynamic", "continuous")
BASELINES = ("hf", "engine")


def dtype_env(args: argparse.Namespace) -> dict[str, str]:
    """The spawned workers' environment for --dtype (none without it)."""
    return {"PDQ_DTYPE": args.dtype} if getattr(args, "dtype", None) else {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_argument_group("what to measure")
    where.add_argument("--target", help="gateway HOST:PORT of a running cluster, or the base URL of any "
                                        "OpenAI-compatible server (http://HOST:PORT/v1; --model names its model)")
    where.add_argument("--doors", default="grpc",
                       help="with --spawn: the API each load is offered through, comma-separated: grpc (default), "
                            "http (the gateway's OpenAI-compatible door; runs named STRATEGY/http), or both")
    where.add_argument("--spawn", action="store_true",
                       help="start a cluster (pdq.ops.up.Cluster) per strategy, and stop it after")
    where.add_argument("--strategies", default=None,
                       help="with --spawn: comma-separated batching strategies, each on its own cluster "
                            f"(default {','.join(STRATEGIES)}); with --target: the label of its strategy")
    where.add_argument("--baseline", action="append", default=[], choices=BASELINES,
                       help="also run the same requests in this process: hf (naive transformers generate() in "
                            "static batches of 8) or engine (pdq's engine core, no RPC); repeatable")
    where.add_argument("--handoff", action="store_true",
                       help="measure P/D disaggregation instead: KV hand-off GB/s (median and long prompt), its "
                            "TTFT overhead, and the split of the mixed workload over 2 decode workers "
                            "(spawns its own cluster; --model, --dtype, --requests, --seed, --env, --json apply)")
    where.add_argument("--scheduler", action="store_true",
                       help="measure the scheduler's goals instead: tenant shares, a light tenant's TTFT under a "
                            "flood, cancel and deadline latencies (spawns its own cluster; --model, --dtype, --requests, "
                            "--env, --json apply)")
    where.add_argument("--capacity", action="store_true",
                       help="measure control-plane capacity instead: step open-loop arrivals of short requests up "
                            "until latency breaks, per --capacity-max-tokens; report the best sustained requests/s "
                            "and streamed tokens/s, each process's CPU (the bottleneck) and Redis's own rate "
                            "(spawns its own cluster; best with --model null; --model, --dtype, --env, --stream-interval, "
                            "--seed, --json and the cluster flags apply)")
    cap = p.add_argument_group("--capacity sweeps (pdq.bench.capacity_policy)")
    cap.add_argument("--capacity-max-tokens", default="8,128",
                     help="one sweep per value: the max_tokens of every request (default 8,128: submits, then "
                          "streamed tokens)")
    cap.add_argument("--no-capacity-ceiling", dest="capacity_ceiling", action="store_false",
                     help="skip the same sweeps against a bare gRPC GenerateStream server (pdq.bench.stream_ceiling), "
                          "the transport's own ceiling on this machine, run after the cluster's")
    cap.add_argument("--capacity-prompt-tokens", type=int, default=8, help="prompt tokens per request (default 8)")
    cap.add_argument("--capacity-start", type=float, default=50.0, help="first offered rate, requests/s (default 50)")
    cap.add_argument("--capacity-factor", type=float, default=1.5, help="rate multiplier per step (default 1.5)")
    cap.add_argument("--capacity-step-s", type=float, default=3.0, help="seconds of arrivals per step (default 3)")
    cap.add_argument("--capacity-p99-ms", type=float, default=500.0,
                     help="latency breaks past this p99 submit->done, in ms (default 500), plus "
                          "--capacity-token-ms per output token after the first; also on any error, or when "
                          "completed requests/s fall >10%% below the offered rate")
    cap.add_argument("--capacity-token-ms", type=float, default=10.0,
                     help="ms per output token after the first added to the p99 bound (default 10)")
    where.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="extra environment of every spawned process, e.g. PDQ_STRATEGY_BATCH_SIZE=8 (repeatable)")
    up = p.add_argument_group("the spawned cluster (as `pdq up`)")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers, with --separate (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    mode = up.add_mutually_exclusive_group()
    mode.add_argument("--colocate", dest="colocate", action="store_true", default=True,
                      help=UP_COLOCATE_HELP + " (the default)")
    mode.add_argument("--separate", dest="colocate", action="store_false", help=UP_SEPARATE_HELP)
    up.add_argument("--control-policy", choices=cpu.POLICIES, default=os.environ.get("PDQ_UP_CONTROL_POLICY") or "batch",
                    help=UP_CONTROL_POLICY_HELP)
    up.add_argument("--model", default=os.environ.get("PDQ_MODEL", "builtin"),
                    help="builtin, builtin:tiny, builtin:small, builtin:1b (for a GPU), null or null:STEP_MS (no compute: "
                         "pdq.model.null) or a checkpoint dir; with --target, the model the cluster serves (its "
                         "vocabulary makes the prompts)")
    up.add_argument("--redis-url", default=os.environ.get("PDQ_UP_REDIS_URL"),
                    help="use this Redis instead of starting a private one")
    up.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                    help="the model's dtype in the spawned workers, the baselines and the roofline alike (default: "
                         "$PDQ_DTYPE, else what a worker runs on this machine: bfloat16 on a CPU with AMX or "
                         "AVX512_BF16, float32 on other CPUs, bfloat16 on a GPU)")
    load = p.add_argument_group("workload and load")
    load.add_argument("--workload", default="mixed", choices=WORKLOADS, help="default mixed")
    load.add_argument("--requests", "-n", type=int, default=None,
                      help="requests per run (default: the workload's own, 32 for mixed)")
    load.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    load.add_argument("--max-model-len", type=int, default=2048, help="prompt + output limit of the cluster")
    arrival = load.add_mutually_exclusive_group()
    arrival.add_argument("--rate", type=str, default=None, help="Poisson arrivals at R requests/s")
    arrival.add_argument("--rates", type=str, default=None, help="a sweep of rates, e.g. 1,2,4,inf (inf = all at once)")
    arrival.add_argument("--concurrency", type=str, default=None,
                         help="closed loop: C requests in flight (a list such as 1,8,32 sweeps)")
    load.add_argument("--api-key", default=None,
                      help="with --target: the API key of every request (default: $PDQ_API_KEY, else the dev key "
                           "of a local `pdq up`); a spawned cluster gets a fresh key per tenant")
    load.add_argument("--tenant-key", action="append", default=[], metavar="TENANT=KEY",
                      help="the API key of one tenant's requests, e.g. flood=sk-... (repeatable)")
    load.add_argument("--client-policy", choices=cpu.POLICIES, default="batch",
                      help="CPU policy of this process's client threads (pdq.ops.cpu): batch (default) lets the cluster's "
                           "model threads keep the cores when a token wakes a client, as clients on other machines "
                           "would; its timestamps can only come later for it. normal: compete as any process")
    load.add_argument("--stream-interval", type=int, default=1, metavar="N",
                      help="decode steps between writes of a request's tokens, each sent as one stream message "
                           f"after the first token alone (GenerateRequest.stream_interval, 1..{MAX_STREAM_INTERVAL}; "
                           "default 1: a message per token)")
    load.add_argument("--repeat", type=int, default=1,
                      help="run everything N times in alternating order; report each run's median repeat (default 1)")
    load.add_argument("--warmup", type=int, default=2, help="small requests sent to each cluster first (default 2)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    out = p.add_argument_group("reports")
    out.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="goodput SLO on time to first token")
    out.add_argument("--slo-itl", type=float, default=None, metavar="MS",
                     help="goodput SLO on inter-token latency (a request's mean gap, TPOT)")
    out.add_argument("--json", default=None, metavar="FILE", help="write every run's numbers as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="throughput-latency curves per strategy")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--no-roofline", action="store_true",
                     help="skip the matrix-multiply roofline (the workload's GEMMs alone, timed here in each repeat "
                          "beside its runs; each run's efficiency is its tokens/s over its repeat's roofline's)")


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {item!r}")
        out[key] = value
    return out


@dataclass(frozen=True)
class BenchOptions:
    target: str | None
    spawn: bool
    strategies: tuple[str, ...]
    baselines: tuple[str, ...]
    loads: tuple[Arrivals, ...]
    workload: str = "mixed"
    requests: int | None = None
    seed: int = 0
    max_model_len: int = 2048
    model: str = "builtin"
    prefill: int = 1
    decode: int = 1
    colocate: bool = True  # as `pdq up`: one colocated worker per --decode
    control_policy: str = "batch"
    client_policy: str = "batch"
    stream_interval: int = 1
    doors: tuple[str, ...] = ("grpc",)
    redis_url: str | None = None
    dtype: str | None = None  # as given; None: the run resolves it (pdq.bench.command.run_dtype)
    env: dict = field(default_factory=dict)
    api_keys: dict = field(default_factory=dict)
    warmup: int = 2
    repeat: int = 1
    request_timeout: float = 600.0
    slo_ttft: float | None = None
    slo_itl: float | None = None
    json: str | None = None
    plot: str | None = None
    progress: bool = True
    roofline: bool = True

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "BenchOptions":
        """Raises ValueError naming the flag when the combination makes no sense."""
        if a.target and a.spawn:
            raise ValueError("give either --target or --spawn, not both")
        if not (a.target or a.spawn or a.baseline):
            raise ValueError("nothing to measure: give --target HOST:PORT, --spawn, or a --baseline")
        if a.strategies is None:
            strategies = STRATEGIES if a.spawn else ("target",) if a.target else ()
        else:
            strategies = tuple(s.strip() for s in a.strategies.split(",") if s.strip())
            if a.spawn and (bad := [s for s in strategies if s not in STRATEGIES]):
                raise ValueError(f"--strategies: unknown {', '.join(bad)}; choose from {', '.join(STRATEGIES)}")
            if a.target and len(strategies) != 1:
                raise ValueError("--strategies with --target: one label (a running cluster has one strategy)")
            if not strategies:
                raise ValueError("--strategies: empty")
        if len(set(strategies)) != len(strategies):
            raise ValueError("--strategies: a strategy is listed twice")
        if a.concurrency:
            loads = tuple(Arrivals(concurrency=c, seed=a.seed) for c in parse_concurrency(a.concurrency))
        else:
            rates = parse_rates(a.rates or a.rate) if (a.rates or a.rate) else [math.inf]
            loads = tuple(Arrivals(rate=r, seed=a.seed) for r in rates)
        for name, least in (("prefill", 1), ("decode", 1), ("repeat", 1), ("warmup", 0)):
            if getattr(a, name) < least:
                raise ValueError(f"--{name} must be >= {least}")
        if not 1 <= a.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"--stream-interval must be 1..{MAX_STREAM_INTERVAL}, got {a.stream_interval}")
        for name in ("slo_ttft", "slo_itl", "request_timeout"):
            value = getattr(a, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        doors = tuple(d.strip() for d in a.doors.split(",") if d.strip())
        if not doors or set(doors) - {"grpc", "http"} or len(set(doors)) != len(doors):
            raise ValueError(f"--doors: grpc, http or both, got {a.doors!r}")
        if doors != ("grpc",) and not a.spawn:
            raise ValueError("--doors: with --spawn (a --target is one door: its address says which)")
        env = _pairs(a.env, "--env")
        if "PDQ_STRATEGY" in env:
            raise ValueError("--env PDQ_STRATEGY: use --strategies")
        if "PDQ_DTYPE" in env:
            raise ValueError("--env PDQ_DTYPE: use --dtype (the baselines and the roofline take it too)")
        env.update(dtype_env(a))
        keys = _pairs(a.tenant_key, "--tenant-key")
        if a.api_key:
            keys["*"] = a.api_key
        return cls(target=a.target, spawn=a.spawn, strategies=strategies, baselines=tuple(dict.fromkeys(a.baseline)),
                   loads=loads, workload=a.workload, requests=a.requests, seed=a.seed,
                   max_model_len=a.max_model_len, model=a.model, prefill=a.prefill, decode=a.decode,
                   colocate=a.colocate, control_policy=a.control_policy, client_policy=a.client_policy,
                   stream_interval=a.stream_interval, doors=doors, redis_url=a.redis_url, dtype=a.dtype, env=env,
                   api_keys=keys, warmup=a.warmup, repeat=a.repeat,
                   request_timeout=a.request_timeout, slo_ttft=a.slo_ttft, slo_itl=a.slo_itl, json=a.json,
                   plot=a.plot, progress=not a.no_progress, roofline=not getattr(a, "no_roofline", False))

    def api_key(self, tenant: str) -> str | None:
        """The key of `tenant`'s requests: its --tenant-key, else --api-key, else none."""
        return self.api_keys.get(tenant, self.api_keys.get("*"))
