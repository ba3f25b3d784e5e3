"""`pdq bench`: build the workload, run it through every strategy and baseline, report.

Order: each strategy on its own freshly spawned cluster (or the --target cluster), every
offered load in turn; then the baselines in this process, after the clusters have stopped, so
they never compete with one for the CPU. Stdout gets the tables; stderr the progress.
"""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pdq.bench import report
from pdq.bench.metrics import Slo, summarize
from pdq.bench.options import BenchOptions
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import Workload, build, vocabulary


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar on stderr for one run: requests done, tokens received."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        self.tokens = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, rec: RequestRecord) -> None:
        self.tokens += rec.output_tokens
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.tokens} tokens" + (" (errors)" if rec.error else ""), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Bench:
    def __init__(self, opts: BenchOptions, workload: Workload):
        self.opts = opts
        self.workload = workload
        self.slo = Slo(opts.slo_ttft, opts.slo_itl)
        self.runs: list[dict] = []

    def measure(self, desc: str, go: Callable[[Progress], RunRecord]) -> None:
        progress = Progress(len(self.workload.requests), desc, self.opts.progress)
        try:
            record = go(progress)
        finally:
            progress.close()
        entry = summarize(record, self.slo)
        self.runs.append(entry)
        say(f"pdq bench: {entry['name']} @ {entry['arrivals']}: {entry['output_tokens_per_s']:.1f} output tok/s, "
            f"{entry['completed']}/{entry['requests']} ok, TTFT p99 {entry['ttft_ms']['p99']} ms"
            + (f", client CPU {entry['client_cpu_pct']}%" if entry["client_cpu_pct"] is not None else ""))
        for error in entry["errors_sample"]:
            say(f"    error: {error}")

    def service(self, target: str, strategy: str, keys: dict[str, str | None]) -> None:
        """Every offered load against the cluster at `target`; keys: tenant -> API key (None:
        the client's default, $PDQ_API_KEY or a local `pdq up`'s dev key)."""
        from pdq.bench.service import run_service, warm_up

        opts = self.opts
        warm_up(target, self.workload.requests[0].prompt_token_ids[0], opts.warmup,
                api_key=next(iter(keys.values()), None), timeout_s=opts.request_timeout)
        for load in opts.loads:
            self.measure(f"{strategy} @ {load.label}", lambda p: run_service(
                target, strategy, strategy, self.workload, load, api_keys=keys, timeout_s=opts.request_timeout,
                on_done=p))

    def spawned(self, strategy: str) -> None:
        """A fresh cluster for `strategy`, with a key per tenant of the workload (bench.tenancy)."""
        import tempfile

        from pdq.bench.tenancy import write_auth_file
        from pdq.up import Cluster

        opts = self.opts
        with tempfile.TemporaryDirectory(prefix="pdq-bench-") as tmp:
            auth_file = Path(tmp) / "auth.json"
            keys = write_auth_file(auth_file, self.workload.tenants, opts.api_keys)
            env = {**opts.env, "PDQ_STRATEGY": strategy, "PDQ_AUTH_FILE": str(auth_file)}
            say(f"pdq bench: starting a cluster for strategy {strategy!r} ...")
            with Cluster(prefill=opts.prefill, decode=opts.decode, model=opts.model, redis_url=opts.redis_url,
                         port=0, auth=False, extra_env=env) as cluster:
                self.service(cluster.target, strategy, keys)

    def baselines(self, model_dir: str) -> None:
        opts = self.opts
        if "engine" in opts.baselines:
            from pdq.bench.baselines import EngineBaseline

            say("pdq bench: loading the in-process engine ...")
            engine = EngineBaseline(model_dir)
            for load in opts.loads:
                self.measure(f"engine @ {load.label}", lambda p: engine.run(self.workload, load, on_done=p))
            del engine
        if "hf" in opts.baselines:
            from pdq.bench.baselines import HFBaseline

            say("pdq bench: loading the model into transformers ...")
            hf = HFBaseline(model_dir)
            self.measure("hf @ all", lambda p: hf.run(self.workload, on_done=p))


def config_json(opts: BenchOptions, model_dir: str, workload: Workload) -> dict:
    return {"model": opts.model, "model_dir": model_dir, "workload": workload.describe(), "seed": opts.seed,
            "requests": len(workload.requests), "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens, "target": opts.target, "spawn": opts.spawn,
            "strategies": list(opts.strategies), "baselines": list(opts.baselines),
            "loads": [a.offered() for a in opts.loads], "prefill": opts.prefill, "decode": opts.decode,
            "env": opts.env, "slo": Slo(opts.slo_ttft, opts.slo_itl).to_json(), "max_model_len": opts.max_model_len}


def _command_line() -> list[str] | None:
    argv = sys.argv
    return argv[argv.index("bench") + 1:] if "bench" in argv else None


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every request of every run completed, 1 otherwise, 2 on bad flags."""
    try:
        opts = BenchOptions.from_args(args)
        from pdq.model.loader import resolve_model

        model_dir = str(resolve_model(opts.model))
        workload = build(opts.workload, vocabulary(model_dir), n=opts.requests, seed=opts.seed,
                         max_model_len=opts.max_model_len)
    except ValueError as exc:
        say(f"pdq bench: {exc}")
        return 2
    say(f"pdq bench: {workload.describe()}")
    if opts.target and len(workload.tenants) > 1 and not all(opts.api_key(t.name) for t in workload.tenants):
        say("pdq bench: note: not every tenant has a --tenant-key, so the server may see fewer tenants than the "
            "workload has; shares are measured from the client side")
    bench = Bench(opts, workload)
    if opts.target:
        bench.service(opts.target, opts.strategies[0], {t.name: opts.api_key(t.name) for t in workload.tenants})
    if opts.spawn:
        for strategy in opts.strategies:
            bench.spawned(strategy)
    if opts.baselines:
        bench.baselines(model_dir)

    runs = bench.runs
    print(report.table(runs))
    for extra in (report.tenant_table(runs), report.kind_table(runs)):
        if extra:
            print()
            print(extra)
    rs = report.ratios(runs)
    if rs:
        print()
        print("ratios at the same offered load (same run, same requests):")
        print(report.ratio_lines(rs))
    sys.stdout.flush()
    if opts.json:
        report.write_json(opts.json, report.document(runs, config_json(opts, model_dir, workload), _command_line()))
        say(f"pdq bench: wrote {opts.json}")
    if opts.plot:
        from pdq.bench.plot import plot

        plot(runs, opts.plot, title=f"pdq bench: {workload.name}, {len(workload.requests)} requests, {opts.model}")
        say(f"pdq bench: wrote {opts.plot}")
    return 0 if all(r["errors"] == 0 for r in runs) else 1
