"""`pdq bench`: build the workload, run it through every strategy and baseline, report.

Each strategy runs on its own freshly spawned cluster (or the --target cluster), every offered
load in turn; the baselines run in this process while no spawned cluster is up, so they never
compete with one for the CPU. With --repeat N the whole sequence runs N times, in alternating
order (forward, backward, ...) so slow drift of a shared machine's load hits every system
alike; each run is then reported by its median repeat. Stdout gets the tables; stderr the
progress.
"""

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdq.bench import report
from pdq.bench.metrics import Slo, summarize
from pdq.bench.options import BenchOptions
from pdq.bench.record import RequestRecord, RunRecord
from pdq.bench.workload import Workload, build, for_repeat, vocabulary

if TYPE_CHECKING:
    from pdq.bench.prefix import PrefixProbe
    from pdq.bench.procstat import CpuProbe


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
    """One invocation: runs systems, keeps every run's summary (`runs`), tagged with its repeat."""

    def __init__(self, opts: BenchOptions, workload: Workload, vocab: list[int]):
        self.opts = opts
        self.workload = workload
        self.vocab = vocab
        self._offers = 0  # runs offered so far: each gets its own prompt tokens
        self.slo = Slo(opts.slo_ttft, opts.slo_itl)
        self.runs: list[dict] = []  # every run of every repeat
        self.repeat = 0
        self._baselines: dict = {}
        self.dtype = run_dtype(opts.dtype)
        self.roofs: list = []  # the roofline timed in each repeat (`roofline`)
        self._no_roofline = False  # a model the roofline cannot time

    def offered(self) -> Workload:
        """The workload as the next run offers it: the same lengths and sharing as every other
        run's, fresh prompt tokens each time (`for_repeat`), so no run meets a prefix cache that
        an earlier run (another load, door or repeat of the same cluster or engine) filled."""
        self._offers += 1
        return for_repeat(self.workload, self.vocab, self._offers - 1)

    def measure(self, desc: str, go: Callable[[Progress], RunRecord]) -> None:
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        progress = Progress(len(self.workload.requests), desc, self.opts.progress)
        try:
            record = go(progress)
        finally:
            progress.close()
        entry = summarize(record, self.slo)
        entry["repeat"] = self.repeat
        entry["loadavg_1m_before"] = None if load_before is None else round(load_before, 2)
        self.runs.append(entry)
        rep = f" (repeat {self.repeat + 1}/{self.opts.repeat})" if self.opts.repeat > 1 else ""
        who = "CPU" if entry["name"] in report.BASELINE_NAMES else "client CPU"
        cpu = f", {who} {entry['client_cpu_pct']}%" if entry["client_cpu_pct"] is not None else ""
        if entry["server_cpu_pct"]:
            cpu += ", " + ", ".join(f"{k} {v:.0f}%" for k, v in entry["server_cpu_pct"].items())
        say(f"pdq bench: {entry['name']} @ {entry['arrivals']}{rep}: {entry['output_tokens_per_s']:.1f} output tok/s, "
            f"{entry['completed']}/{entry['requests']} ok, TTFT p99 {entry['ttft_ms']['p99']} ms{cpu}")
        for error in entry["errors_sample"]:
            say(f"    error: {error}")

    def service(self, target: str, strategy: str, keys: dict[str, str | None],
                cpu_probe: "CpuProbe | None" = None, prefix_probe: "PrefixProbe | None" = None) -> None:
        """Every offered load against the cluster at `target`; keys: tenant -> API key (None:
        the client's default, $PDQ_API_KEY or a local `pdq up`'s dev key)."""
        from pdq.bench.service import is_http, run_service, warm_up

        opts = self.opts
        name = f"{strategy}/http" if is_http(target) and opts.spawn else strategy
        warm_up(target, self.workload.requests[0].prompt_token_ids[0], opts.warmup,
                api_key=next(iter(keys.values()), None), timeout_s=opts.request_timeout, http_model=opts.model)
        for load in opts.loads:
            self.measure(f"{name} @ {load.label}", lambda p: run_service(
                target, name, strategy, self.offered(), load, api_keys=keys, timeout_s=opts.request_timeout,
                on_done=p, cpu_probe=cpu_probe, client_policy=opts.client_policy,
                stream_interval=opts.stream_interval, prefix_probe=prefix_probe, http_model=opts.model))

    def spawned(self, strategy: str) -> None:
        """A fresh cluster for `strategy`, with a key per tenant of the workload (bench.tenancy).
        A failed start-up (e.g. a port taken in between by another process) is retried."""
        import tempfile

        from pdq.bench.prefix import cluster_prefix_probe
        from pdq.ops.redis_server import free_port
        from pdq.bench.procstat import cluster_probe
        from pdq.bench.tenancy import write_auth_file
        from pdq.bench.spawn import start_cluster

        opts = self.opts
        with tempfile.TemporaryDirectory(prefix="pdq-bench-") as tmp:
            auth_file = Path(tmp) / "auth.json"
            keys = write_auth_file(auth_file, self.workload.tenants, opts.api_keys)
            env = {**opts.env, **({"PDQ_DTYPE": self.dtype} if self.dtype else {}), "PDQ_STRATEGY": strategy,
                   "PDQ_AUTH_FILE": str(auth_file)}
            cluster = start_cluster(f"strategy {strategy!r}", say, prefill=opts.prefill, decode=opts.decode,
                                    model=opts.model, colocate=opts.colocate, control_policy=opts.control_policy,
                                    redis_url=opts.redis_url, port=0, auth=False, extra_env=env,
                                    http_port=free_port() if "http" in opts.doors else 0)
            try:
                # one cluster, each door in turn (in alternating order, as the systems of a repeat)
                for door in opts.doors if self.repeat % 2 == 0 else opts.doors[::-1]:
                    self.service(cluster.base_url if door == "http" else cluster.target, strategy, keys,
                                 cluster_probe(cluster), cluster_prefix_probe(cluster))
            finally:
                cluster.stop()

    def baseline(self, name: str, model_dir: str) -> None:
        """Runs baseline `name` ("engine": every offered load; "hf": all at once); its model
        loads on first use and stays loaded for the next repeat."""
        from pdq.bench.baselines import EngineBaseline, HFBaseline

        if name not in self._baselines:
            say(f"pdq bench: loading the model for the {name} baseline ...")
            self._baselines[name] = (EngineBaseline if name == "engine" else HFBaseline)(model_dir, dtype=self.dtype)
        system = self._baselines[name]
        if name == "engine":
            for load in self.opts.loads:
                self.measure(f"engine @ {load.label}", lambda p: system.run(self.offered(), load, on_done=p))
        else:
            self.measure("hf @ all", lambda p: system.run(self.offered(), on_done=p))

    def roofline(self, model_dir: str) -> None:
        """Times the workload's matrix-multiply roofline (`pdq.bench.roofline`) in this repeat,
        beside its runs: on a shared machine a roofline timed once, minutes from a run, measures
        the machine's mood as much as the run."""
        from pdq.bench import roofline

        if self._no_roofline:
            return
        say("pdq bench: timing the workload's matrix multiplies alone (the roofline) ...")
        try:
            roof = roofline.measure(model_dir, self.workload, dtype=self.dtype)
        except ValueError as exc:  # a model this runtime cannot run (UnsupportedModelError)
            say(f"pdq bench: no roofline: {exc}")
            self._no_roofline = True
            return
        self.roofs.append(roof)
        rep = f" (repeat {self.repeat + 1}/{self.opts.repeat})" if self.opts.repeat > 1 else ""
        say(f"pdq bench: roofline{rep}: {roof.output_tokens_per_s:.1f} output tok/s")

    def systems(self, model_dir: str) -> list[Callable[[], None]]:
        """What one repeat runs, in order: the target or the spawned strategies, the baselines,
        then the roofline (the repeats alternate the order, so the roofline is timed next to the
        baselines' runs)."""
        opts = self.opts
        out: list[Callable[[], None]] = []
        if opts.target:
            keys = {t.name: opts.api_key(t.name) for t in self.workload.tenants}
            out.append(lambda: self.service(opts.target, opts.strategies[0], keys))
        if opts.spawn:
            out += [lambda s=s: self.spawned(s) for s in opts.strategies]
        out += [lambda b=b: self.baseline(b, model_dir) for b in opts.baselines]
        if opts.roofline:
            out.append(lambda: self.roofline(model_dir))
        return out


def run_dtype(given: str | None) -> str | None:
    """The dtype every system of the run uses: --dtype, else PDQ_DTYPE, else what a worker on this
    machine runs by default (`pdq.engine.runner.resolve_dtype`: bfloat16 on a CPU with AMX or AVX512_BF16); None:
    the runtime's default (a GPU's)."""
    from pdq.engine.runner import default_device, dtype_name, resolve_dtype

    dtype = resolve_dtype(given or os.environ.get("PDQ_DTYPE"), default_device())
    return dtype_name(dtype) if dtype is not None else None


def config_json(opts: BenchOptions, model_dir: str, workload: Workload, dtype: str | None = None) -> dict:
    return {"model": opts.model, "model_dir": model_dir, "workload": workload.describe(), "seed": opts.seed,
            "requests": len(workload.requests), "prompt_tokens": workload.prompt_tokens,
            "output_tokens": workload.output_tokens, "target": opts.target, "spawn": opts.spawn,
            "strategies": list(opts.strategies), "baselines": list(opts.baselines),
            "loads": [a.offered() for a in opts.loads], "prefill": opts.prefill, "decode": opts.decode,
            "env": opts.env, "slo": Slo(opts.slo_ttft, opts.slo_itl).to_json(), "max_model_len": opts.max_model_len,
            "repeat": opts.repeat, "colocate": opts.colocate, "control_policy": opts.control_policy,
            "client_policy": opts.client_policy, "stream_interval": opts.stream_interval, "dtype": dtype}


def _command_line() -> list[str] | None:
    argv = sys.argv
    return argv[argv.index("bench") + 1:] if "bench" in argv else None


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 when every request of every run completed, 1 otherwise, 2 on bad flags."""
    if getattr(args, "scheduler", False):
        from pdq.bench.scheduler import run as run_scheduler

        return run_scheduler(args)
    if getattr(args, "capacity", False):
        from pdq.bench.capacity import run as run_capacity

        return run_capacity(args)
    if getattr(args, "handoff", False):
        from pdq.bench.handoff import run as run_handoff

        return run_handoff(args)
    try:
        opts = BenchOptions.from_args(args)
        from pdq.model.loader import resolve_model

        model_dir = str(resolve_model(opts.model))
        vocab = vocabulary(model_dir)
        workload = build(opts.workload, vocab, n=opts.requests, seed=opts.seed,
                         max_model_len=opts.max_model_len)
    except ValueError as exc:
        say(f"pdq bench: {exc}")
        return 2
    say(f"pdq bench: {workload.describe()}")
    if opts.target and len(workload.tenants) > 1 and not all(opts.api_key(t.name) for t in workload.tenants):
        say("pdq bench: note: not every tenant has a --tenant-key, so the server may see fewer tenants than the "
            "workload has; shares are measured from the client side")
    try:
        bench = Bench(opts, workload, vocab)
    except ValueError as exc:  # a PDQ_DTYPE no runtime takes
        say(f"pdq bench: {exc}")
        return 2
    say(f"pdq bench: the model in {bench.dtype or 'the runtime default dtype'} everywhere"
        f"{'' if opts.dtype else ' (--dtype to choose)'}")
    systems = bench.systems(model_dir)
    failed = False
    try:
        for repeat in range(opts.repeat):
            bench.repeat = repeat
            for go in systems if repeat % 2 == 0 else systems[::-1]:
                go()
    except (RuntimeError, TimeoutError, OSError) as exc:  # a cluster that will not start, a dead target
        say(f"pdq bench: stopped: {exc}; reporting the runs done so far")
        failed = True
    if not bench.runs:
        return 1

    runs = report.median_repeats(bench.runs)
    print(report.table(runs))
    for extra in (report.tenant_table(runs), report.kind_table(runs), report.cpu_table(runs),
                  report.prefix_lines(runs)):
        if extra:
            print()
            print(extra)
    rs = report.ratios(runs)
    if rs:
        print()
        print("ratios at the same offered load (same run, same requests):")
        print(report.ratio_lines(rs))
    if bench.roofs:
        print()
        print(report.roofline_lines(bench.runs, bench.roofs))
    sys.stdout.flush()
    if opts.json:
        doc = report.document(runs, config_json(opts, model_dir, workload, bench.dtype), _command_line())
        if bench.roofs:
            doc["roofline"] = {**report.median_roofline(bench.roofs).to_json(),
                               "efficiency": report.efficiencies(bench.runs, bench.roofs),
                               "repeats": [r.to_json() for r in bench.roofs]}
        if opts.repeat > 1:
            doc["all_runs"] = bench.runs
        report.write_json(opts.json, doc)
        say(f"pdq bench: wrote {opts.json}")
    if opts.plot:
        from pdq.bench.plot import plot

        plot(runs, opts.plot, title=f"pdq bench: {workload.name}, {len(workload.requests)} requests, {opts.model}")
        say(f"pdq bench: wrote {opts.plot}")
    return 0 if not failed and all(r["errors"] == 0 for r in bench.runs) else 1
