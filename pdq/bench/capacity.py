"""`pdq bench --capacity`: how many submits/s and streamed tokens/s one gateway + scheduler +
Redis carry before latency breaks, what the bottleneck is, and Redis's own rate in the same run.

One cluster is spawned (`pdq.ops.up.Cluster`, usually `--model null`, so no model compute hides the
control plane) and swept once per `--capacity-max-tokens` value by the rules of
`pdq.bench.capacity_policy`: open-loop arrivals of short prompts (greedy, `ignore_eos`, the
`--stream-interval`), stepping the offered rate up until a step breaks. Each step records every
process's CPU (`pdq.bench.procstat`, and this client's own), Redis's CPU and commands
(`INFO commandstats`) per request. After the sweeps, with the cluster idle, `redis-benchmark`
(when installed) measures the same Redis server's rate of plain commands.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

from pdq.bench.arrivals import Arrivals
from pdq.bench.options import dtype_env
from pdq.bench.capacity_policy import Step, SweepPlan, best, bottleneck, next_rate, why_broken


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def plans(args: argparse.Namespace) -> list[SweepPlan]:
    """One sweep per --capacity-max-tokens value. Raises ValueError on bad flags."""
    try:
        lengths = [int(x) for x in str(args.capacity_max_tokens).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--capacity-max-tokens: integers, comma separated, got {args.capacity_max_tokens!r}") from None
    if not lengths:
        raise ValueError("--capacity-max-tokens: empty")
    return [SweepPlan(max_tokens=n, start_rps=args.capacity_start, factor=args.capacity_factor,
                      step_s=args.capacity_step_s, p99_ms=args.capacity_p99_ms, token_ms=args.capacity_token_ms) for n in lengths]


def workload(plan: SweepPlan, rps: float, prompt_tokens: int, vocab: list[int], seed: int):
    from pdq.bench.workload import BenchRequest, Workload

    rng = random.Random(f"pdq-bench/capacity/{seed}/{plan.max_tokens}/{rps}")
    reqs = tuple(BenchRequest(i, tuple(rng.choice(vocab) for _ in range(prompt_tokens)), plan.max_tokens)
                 for i in range(plan.requests_at(rps)))
    return Workload(f"capacity-{plan.max_tokens}", seed, reqs)


class RedisProbe:
    """INFO commandstats of the cluster's Redis before and after a step: commands per request
    and their time inside Redis."""

    def __init__(self, url: str):
        import redis

        self.client = redis.Redis.from_url(url)
        self._start: dict = {}

    def _stats(self) -> dict:
        return {k.removeprefix("cmdstat_"): v for k, v in self.client.info("commandstats").items()}

    def start(self) -> None:
        self._start = self._stats()

    def stop(self, requests: int) -> dict:
        """{command: {"per_request": calls, "usec_per_call"}} of the step, busiest first."""
        end, out = self._stats(), {}
        for name, s in end.items():
            calls = s["calls"] - self._start.get(name, {}).get("calls", 0)
            usec = s["usec"] - self._start.get(name, {}).get("usec", 0)
            if calls > 0 and requests:
                out[name] = {"per_request": round(calls / requests, 2), "usec_per_call": round(usec / calls, 2),
                             "usec_per_request": round(usec / requests, 1)}
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["usec_per_request"]))


def run_step(target: str, plan: SweepPlan, rps: float, *, prompt_tokens: int, vocab: list[int], seed: int,
             stream_interval: int, cpu_probe, redis_probe: "RedisProbe | None", client_policy: str) -> Step:
    from pdq.bench.metrics import summarize
    from pdq.bench.service import run_service

    work = workload(plan, rps, prompt_tokens, vocab, seed)
    arrivals = Arrivals(rate=rps, seed=seed)
    if redis_probe:
        redis_probe.start()
    busy0 = machine_cpu()
    record = run_service(target, "capacity", "continuous", work, arrivals, timeout_s=max(30.0, 10 * plan.step_s),
                         cpu_probe=cpu_probe, client_policy=client_policy, stream_interval=stream_interval)
    entry = summarize(record)
    commands = redis_probe.stop(entry["completed"]) if redis_probe else {}
    offsets = arrivals.offsets(len(work.requests))
    offered, achieved, tokens_per_s = rates(record, offsets, rps)
    duration = entry["duration_s"]
    cpu = {name: round(100 * s / duration, 1) for name, s in (record.server_cpu_s or {}).items()} if duration else {}
    if record.client_cpu_s is not None and duration:
        cpu["client"] = round(100 * record.client_cpu_s / duration, 1)
    step = Step(target_rps=round(rps, 1), offered_rps=offered, achieved_rps=achieved, tokens_per_s=tokens_per_s,
                p50_ms=entry["e2e_ms"]["p50"], p99_ms=entry["e2e_ms"]["p99"], requests=entry["requests"],
                errors=entry["errors"], cpu_pct=cpu)
    redis_cpu_s = (record.server_cpu_s or {}).get("redis")
    step.extra = {"machine_busy_pct": busy_pct(busy0, machine_cpu()), "ttft_ms": entry["ttft_ms"], "itl_ms": entry["itl_ms"], "duration_s": duration,
                  "errors_sample": entry["errors_sample"], "redis_commands": dict(list(commands.items())[:8]),
                  "redis_usec_per_request": round(sum(c["usec_per_request"] for c in commands.values()), 1),
                  "redis_cpu_ms_per_request": (round(1000 * redis_cpu_s / entry["completed"], 3)
                                               if redis_cpu_s and entry["completed"] else None)}
    step.broke = why_broken(step, plan)
    return step


def machine_cpu() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU since boot (/proc/stat), other users' processes
    included; None off Linux."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def busy_pct(before, after) -> float | None:
    """% of all CPUs busy between two `machine_cpu()` samples (100 = every core busy)."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return round(100 * (after[0] - before[0]) / (after[1] - before[1]), 1)


def rates(record, offsets: list[float], rps: float) -> tuple[float, float, float]:
    """(offered, completed requests/s, streamed tokens/s) of a step in steady state: requests
    over the span of their arrivals, completions over the span of their ends, tokens over the
    span from the first token to the last (each span plus one mean gap), so that a request's own
    latency does not count as a shortfall, while a queue that grows during the step stretches
    the ends and does."""
    gap = 1 / rps
    ends = sorted(r.end for r in record.requests if r.ok)
    times = [t for r in record.requests for t in r.token_times]
    offered = len(offsets) / (offsets[-1] - offsets[0] + gap)
    achieved = len(ends) / (ends[-1] - ends[0] + gap) if ends else 0.0
    tokens = len(times) / (max(times) - min(times) + gap) if times else 0.0
    return round(offered, 1), round(achieved, 1), round(tokens, 1)


def sweep(target: str, plan: SweepPlan, label: str = "capacity", **kw) -> list[Step]:
    steps: list[Step] = []
    while (rps := next_rate(steps, plan)) is not None:
        step = run_step(target, plan, rps, **kw)
        steps.append(step)
        cpu = ", ".join(f"{k} {v:.0f}%" for k, v in sorted(step.cpu_pct.items(), key=lambda kv: -kv[1]))
        say(f"pdq bench: {label} max_tokens={plan.max_tokens} @ {step.offered_rps:.0f}/s offered: "
            f"{step.achieved_rps:.0f} req/s, {step.tokens_per_s:.0f} tok/s, p99 {step.p99_ms} ms, "
            f"machine {step.extra['machine_busy_pct']}% busy"
            f"{'; BROKE: ' + step.broke if step.broke else ''}  [{cpu}]")
    return steps


def transport_ceiling(sweeps: list[SweepPlan], args: argparse.Namespace, vocab: list[int], cores: int) -> list[dict]:
    """The same sweeps against a bare GenerateStream server (`pdq.bench.stream_ceiling`), run
    as the cluster's control processes were (its CPU policy), once the cluster has stopped."""
    import grpc

    from pdq.bench.procstat import CpuProbe
    from pdq.bench.service import warm_up
    from pdq.ops.child import spawn, stop
    from pdq.ops.redis_server import free_port

    port = free_port()
    say("pdq bench: the same sweeps against a bare gRPC GenerateStream server (the transport's ceiling) ...")
    server = spawn([sys.executable, "-m", "pdq.bench.stream_ceiling", str(port)], cpu_policy=args.control_policy)
    target = f"127.0.0.1:{port}"
    try:
        with grpc.insecure_channel(target) as channel:  # up before the first step
            grpc.channel_ready_future(channel).result(timeout=60)
        warm_up(target, vocab[0], max(2, args.warmup))
        probe = CpuProbe({"grpc-server": server.pid})
        out = []
        for plan in sweeps:
            steps = sweep(target, plan, prompt_tokens=args.capacity_prompt_tokens, vocab=vocab, seed=args.seed,
                          stream_interval=args.stream_interval, cpu_probe=probe, redis_probe=None,
                          client_policy=args.client_policy, label="bare gRPC")
            out.append(summary(plan, steps, cores))
        return out
    finally:
        stop(server)


def share_of_ceiling(result: dict, ceiling: dict) -> dict | None:
    """pdq's best sustained requests/s and streamed tokens/s over the bare server's."""
    mine, bare = result.get("best"), ceiling.get("best")
    if not mine or not bare or not bare["requests_per_s"] or not bare["tokens_per_s"]:
        return None
    return {"requests_per_s": round(mine["requests_per_s"] / bare["requests_per_s"], 3),
            "tokens_per_s": round(mine["tokens_per_s"] / bare["tokens_per_s"], 3)}


def redis_benchmark(host: str, port: int) -> dict | None:
    """requests/s of SET on the cluster's Redis, one command per round trip and 16 pipelined
    (redis-benchmark, 50 clients); None when redis-benchmark is not installed."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    out = {}
    for pipeline in (1, 16):
        res = subprocess.run([exe, "-h", host, "-p", str(port), "-t", "set", "-n", str(50_000 * pipeline),
                              "-c", "50", "-P", str(pipeline), "--csv"], capture_output=True, text=True, timeout=120)
        rows = [line.split(",") for line in res.stdout.splitlines() if line.startswith('"SET"')]
        if rows:
            out[f"set_per_s_pipeline_{pipeline}"] = float(rows[0][1].strip('"'))
    return out


def summary(plan: SweepPlan, steps: list[Step], cores: int) -> dict:
    top = best(steps)
    broken = [s for s in steps if s.broke]
    first_broken = min(broken, key=lambda s: s.target_rps) if broken else None
    redis_ms = top.extra.get("redis_cpu_ms_per_request") if top else None
    return {
        "max_tokens": plan.max_tokens, "plan": plan.__dict__,
        "best": None if top is None else {
            "offered_rps": top.offered_rps, "requests_per_s": top.achieved_rps, "tokens_per_s": top.tokens_per_s,
            "p50_ms": top.p50_ms, "p99_ms": top.p99_ms, "cpu_pct": top.cpu_pct,
            "machine_busy_pct": top.extra["machine_busy_pct"],
            "bottleneck": bottleneck(top.cpu_pct, cores)},
        "first_broken": None if first_broken is None else {
            "offered_rps": first_broken.offered_rps, "why": first_broken.broke, "cpu_pct": first_broken.cpu_pct,
            "bottleneck": bottleneck(first_broken.cpu_pct, cores)},
        # what Redis alone could carry of this traffic: requests per second of a whole Redis core
        "redis_ceiling_rps": round(1000 / redis_ms, 1) if redis_ms else None,
        "steps": [s.__dict__ for s in steps],
    }


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every sweep sustained at least one step, 1 otherwise, 2 on bad flags."""
    from pdq.bench.procstat import cluster_probe
    from pdq.bench.report import machine
    from pdq.bench.service import warm_up
    from pdq.bench.workload import vocabulary
    from pdq.model.loader import resolve_model
    from pdq.bench.spawn import start_cluster

    try:
        sweeps = plans(args)
        if not 1 <= args.stream_interval:
            raise ValueError("--stream-interval must be >= 1")
        model_dir = str(resolve_model(args.model))
    except ValueError as exc:
        say(f"pdq bench: {exc}")
        return 2
    vocab = vocabulary(model_dir)
    env = dict(pair.split("=", 1) for pair in args.env)
    env.update(dtype_env(args))
    cluster = start_cluster(f"the capacity sweep (model {args.model!r})", say, prefill=args.prefill,
                            decode=args.decode, model=args.model, colocate=args.colocate,
                            control_policy=args.control_policy, redis_url=args.redis_url, port=0, auth=False,
                            extra_env=env)
    cores = os.cpu_count() or 1
    results, redis_bench = [], None
    try:
        warm_up(cluster.target, vocab[0], max(2, args.warmup))
        probe, redis_probe = cluster_probe(cluster), RedisProbe(cluster.redis_url)
        for plan in sweeps:
            steps = sweep(cluster.target, plan, prompt_tokens=args.capacity_prompt_tokens, vocab=vocab,
                          seed=args.seed, stream_interval=args.stream_interval, cpu_probe=probe,
                          redis_probe=redis_probe, client_policy=args.client_policy)
            results.append(summary(plan, steps, cores))
        if cluster.redis is not None:
            say("pdq bench: redis-benchmark against the same Redis (cluster idle) ...")
            redis_bench = redis_benchmark(cluster.redis.host, cluster.redis.port)
    finally:
        cluster.stop()
    if args.capacity_ceiling:
        ceilings = transport_ceiling(sweeps, args, vocab, cores)
        for result, ceiling in zip(results, ceilings):
            result["ceiling"] = ceiling
            result["share_of_ceiling"] = share_of_ceiling(result, ceiling)
    print(report_text(results, redis_bench))
    if args.json:
        doc = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(["pdq", "bench", *sys.argv[
            sys.argv.index("bench") + 1:]]) if "bench" in sys.argv else None,
               "config": {"model": args.model, "colocate": args.colocate, "prefill": args.prefill,
                          "decode": args.decode, "stream_interval": args.stream_interval, "env": env,
                          "prompt_tokens": args.capacity_prompt_tokens, "control_policy": args.control_policy,
                          "client_policy": args.client_policy, "ceiling": args.capacity_ceiling},
               "machine": machine(), "sweeps": results, "redis_benchmark": redis_bench}
        with open(args.json, "w") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
        say(f"pdq bench: wrote {args.json}")
    return 0 if all(r["best"] for r in results) else 1


def _ceiling_lines(r: dict) -> list[str]:
    """A sweep's bare gRPC server figures, and pdq's share of them, as report lines."""
    lines = []
    if c := (r.get("ceiling") or {}).get("best"):
        lines.append(f"    a bare gRPC GenerateStream server, same client and rules: {c['requests_per_s']:.0f} "
                     f"requests/s, {c['tokens_per_s']:.0f} tokens/s ({c['bottleneck']})")
    if sh := r.get("share_of_ceiling"):
        lines.append(f"    pdq / that ceiling: {sh['requests_per_s']:.2f}x requests/s, "
                     f"{sh['tokens_per_s']:.2f}x tokens/s")
    return lines


def report_text(results: list[dict], redis_bench: dict | None) -> str:
    lines = ["control-plane capacity (best sustained step of each sweep):"]
    for r in results:
        b = r["best"]
        if b is None:
            lines.append(f"  max_tokens={r['max_tokens']}: no step sustained "
                         f"({r['first_broken']['why'] if r['first_broken'] else 'no steps'})")
            lines += _ceiling_lines(r)
            continue
        lines.append(f"  max_tokens={r['max_tokens']}: {b['requests_per_s']:.0f} requests/s, "
                     f"{b['tokens_per_s']:.0f} streamed tokens/s, p99 {b['p99_ms']} ms")
        lines.append(f"    bottleneck at the best step: {b['bottleneck']}; all CPUs {b['machine_busy_pct']}% busy "
                     "(other processes included)")
        if r["first_broken"]:
            fb = r["first_broken"]
            lines.append(f"    broke at {fb['offered_rps']:.0f}/s offered ({fb['why']}): {fb['bottleneck']}")
        if r["redis_ceiling_rps"]:
            lines.append(f"    Redis alone could carry ~{r['redis_ceiling_rps']:.0f} requests/s of this traffic "
                         f"(its CPU per request at the best step, on one whole core)")
        lines += _ceiling_lines(r)
    if redis_bench:
        lines.append("  redis-benchmark on the same Redis: " +
                     ", ".join(f"{k} {v:.0f}" for k, v in redis_bench.items()))
    return "\n".join(lines)
