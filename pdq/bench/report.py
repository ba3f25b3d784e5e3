"""The terminal table, the ratios between runs, and the `--json` document.

Speed goals are ratios between runs of the same invocation at the same offered load (this
machine is shared and noisy; absolute numbers move, ratios measured side by side much less).
"""

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

BASELINE_NAMES = ("hf", "engine")
SCHEMA_VERSION = 1

# (a, b, metric, goal) from issues 3, 8, 22 and 23: a ratio of a to b of at least `goal`. For
# "output_tokens_per_s" (and "output_tokens_per_cpu_s") the ratio is a's / b's; for "ttft_p99"
# it is b's / a's (a's is lower).
# "service" stands for a run of the whole service with the default (continuous) strategy.
# The goals are stated on the `mixed` workload only.
GOAL_WORKLOAD = "mixed"
GOALS = (
    ("continuous", "static", "output_tokens_per_s", 3.0),
    ("continuous", "static", "ttft_p99", 10.0),
    ("service", "hf", "output_tokens_per_s", 2.4),
    ("service", "engine", "output_tokens_per_s", 0.95),  # issue 22 (issue 3 asked 0.9)
    ("continuous/http", "continuous", "output_tokens_per_s", 0.95),
)
HTTP_TTFT_GOAL_MS = 5.0  # the HTTP door's TTFT p50 within this of the gRPC door's


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _lat(d: dict) -> str:
    return "/".join(_fmt(d.get(k)) for k in ("p50", "p90", "p99"))


def _columns(head: list[str], rows: list[list]) -> list[str]:
    """Lines of a text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells: list) -> str:
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]


def table(runs: list[dict]) -> str:
    """One row per run: throughput first, then latency percentiles (ms), never one blended number."""
    head = ["run", "offered", "ok", "out tok/s", "req/s", "TTFT p50/p90/p99", "ITL p50/p90/p99",
            "e2e p50/p90/p99", "goodput", "tok/CPU-s"]
    rows = [[r["name"], r["arrivals"], f"{r['completed']}/{r['requests']}", _fmt(r["output_tokens_per_s"], 1),
             _fmt(r["requests_per_s"], 2), _lat(r["ttft_ms"]), _lat(r["itl_ms"]), _lat(r["e2e_ms"]),
             _fmt(r["goodput"], 2), _fmt(r.get("output_tokens_per_cpu_s"), 1)] for r in runs]
    out = _columns(head, rows)
    out.append("latencies in ms; goodput in requests/s meeting the SLO" + _slo_note(runs)
               + "; tok/CPU-s: output tokens per CPU-second of every process involved")
    return "\n".join(out)


def _slo_note(runs: list[dict]) -> str:
    slo = runs[0]["slo"] if runs else {}
    parts = [f"TTFT <= {slo['ttft_ms']:g} ms" if slo.get("ttft_ms") else "",
             f"ITL <= {slo['itl_ms']:g} ms" if slo.get("itl_ms") else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else " (no SLO given: every completed request)"


def tenant_table(runs: list[dict]) -> str:
    """Per tenant: its share of output tokens (over the run, and while every tenant had work)
    next to its fair share (weight / sum of weights)."""
    head = ["run @ offered: tenant", "weight", "fair share", "share", "share contended", "tok/s", "TTFT p50/p99"]
    rows = [[f"{r['name']} @ {r['arrivals']}: {name}", f"{t['weight']:g}", f"{t['fair_share']:.2f}",
             f"{t['share']:.2f}", f"{t['share_contended']:.2f}", _fmt(t["output_tokens_per_s"], 1),
             f"{_fmt(t['ttft_ms']['p50'])}/{_fmt(t['ttft_ms']['p99'])}"]
            for r in runs for name, t in (r.get("tenants") or {}).items()]
    return "\n".join(_columns(head, rows)) if rows else ""


def kind_table(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        for kind, k in (r.get("kinds") or {}).items():
            lines.append(f"{r['name']} @ {r['arrivals']}: {kind:>6} requests ({k['requests']}): "
                         f"TTFT p50/p90/p99 {_lat(k['ttft_ms'])} ms, e2e {_lat(k['e2e_ms'])} ms")
    return "\n".join(lines)


def median_repeats(runs: list[dict]) -> list[dict]:
    """One entry per (name, offered load): the repeat with the median output tokens/s (the
    lower middle for an even count), with every repeat's throughput and p99 TTFT under
    "repeats". A single repeat passes through unchanged. Order: first appearance."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["name"], r["arrivals"]), []).append(r)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        ranked = sorted(group, key=lambda r: r["output_tokens_per_s"])
        chosen = dict(ranked[(len(ranked) - 1) // 2])
        chosen["repeats"] = {"n": len(group), "output_tokens_per_s": [r["output_tokens_per_s"] for r in group],
                             "ttft_p99_ms": [r["ttft_ms"]["p99"] for r in group]}
        out.append(chosen)
    return out


def cpu_table(runs: list[dict]) -> str:
    """CPU use during each run, in % of one core: every process of a spawned cluster, and this
    benchmark process ("bench": the load generator, or for a baseline the baseline itself)."""
    rows = [r for r in runs if r.get("client_cpu_pct") is not None]
    if not any(r.get("server_cpu_pct") for r in rows):
        return ""
    names = list(dict.fromkeys(n for r in rows for n in r.get("server_cpu_pct") or {}))
    lines = [f"CPU during the run, % of one core (this machine has {os.cpu_count()} cores):",
             "  " + "run @ offered".ljust(22) + "".join(n.rjust(11) for n in [*names, "bench", "total"])]
    for r in rows:
        cpu = r.get("server_cpu_pct") or {}
        total = sum(cpu.values()) + (r["client_cpu_pct"] or 0)
        cells = [_fmt(cpu.get(n)) for n in names] + [_fmt(r["client_cpu_pct"]), _fmt(total)]
        lines.append("  " + f"{r['name']} @ {r['arrivals']}".ljust(22) + "".join(c.rjust(11) for c in cells))
    return "\n".join(lines)


def prefix_lines(runs: list[dict]) -> str:
    """Prompt tokens each run found in its prefix cache, of those it looked up ("" when no run
    looked any up, e.g. a --target cluster, whose workers the benchmark does not read)."""
    rows = [(r, r["prefix_cache"]) for r in runs if (r.get("prefix_cache") or {}).get("queried_tokens")]
    if not rows:
        return ""
    lines = ["prefix cache (prompt tokens found in it / looked up):"]
    for r, pc in rows:
        q, h = pc["queried_tokens"], pc["hit_tokens"]
        line = f"  {r['name']} @ {r['arrivals']}: {h:,} / {q:,} ({100 * h / q:.0f}%)"
        if pc.get("handoff_bytes") or pc.get("handoff_skipped_tokens"):  # separate prefill and decode workers
            line += (f"; hand-offs carried {pc['handoff_bytes'] / 1e6:,.1f} MB of K/V and left out "
                     f"{pc['handoff_skipped_tokens']:,} prompt positions the decode worker held")
        lines.append(line)
    return "\n".join(lines)


def _metric(run: dict, metric: str) -> float | None:
    return run["ttft_ms"]["p99"] if metric == "ttft_p99" else run.get(metric)


def ratios(runs: list[dict]) -> list[dict]:
    """Ratios between runs at the same offered load: every service run against each baseline
    and against every other strategy (throughput, and p99 TTFT), with the goals marked."""
    by_load: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_load.setdefault(r["arrivals"], {})[r["name"]] = r
    out = []

    def add(a: dict, b: dict, metric: str, load: str) -> None:
        x, y = _metric(a, metric), _metric(b, metric)
        if metric == "ttft_p99":  # b's latency over a's: > 1 means a is faster
            x, y = y, x
        value = round(x / y, 3) if x and y else None
        entry = {"offered": load, "a": a["name"], "b": b["name"], "metric": metric, "value": value, "goal": None}
        for ga, gb, gm, goal in GOALS:
            a_ok = ga == a["name"] or (ga == "service" and a["strategy"] in ("continuous", "target"))
            if a_ok and gb == b["name"] and gm == metric and a["workload"] == GOAL_WORKLOAD:
                entry["goal"], entry["met"] = goal, value is not None and value >= goal
        out.append(entry)

    for load, named in by_load.items():
        service = [r for n, r in named.items() if n not in BASELINE_NAMES]
        for a in service:
            for b in (named.get("hf"), named.get("engine")):
                if b is not None:
                    add(a, b, "output_tokens_per_s", load)
                    add(a, b, "output_tokens_per_cpu_s", load)
        for a in service:
            for b in service:
                if a is not b and a["name"] == "continuous" and not b["name"].endswith("/http"):
                    add(a, b, "output_tokens_per_s", load)
                    add(a, b, "ttft_p99", load)
            grpc_door = named.get(a["name"].removesuffix("/http"))
            if a["name"].endswith("/http") and grpc_door is not None:  # the same cluster through both doors
                add(a, grpc_door, "output_tokens_per_s", load)
                extra = round(a["ttft_ms"]["p50"] - grpc_door["ttft_ms"]["p50"], 1)
                out.append({"offered": load, "a": a["name"], "b": grpc_door["name"], "metric": "ttft_p50_extra_ms",
                            "value": extra, "goal": HTTP_TTFT_GOAL_MS, "met": extra <= HTTP_TTFT_GOAL_MS})
        if "engine" in named and "hf" in named:
            add(named["engine"], named["hf"], "output_tokens_per_s", load)
            add(named["engine"], named["hf"], "output_tokens_per_cpu_s", load)
    return out


def ratio_lines(rs: list[dict]) -> str:
    lines = []
    for r in rs:
        if r["metric"] == "ttft_p50_extra_ms":
            lines.append(f"{r['offered']:>8}  {r['a']} vs {r['b']}: TTFT p50 {r['value']:+.1f} ms"
                         f"   goal <= +{r['goal']:g} ms: {'met' if r['met'] else 'NOT met'}")
            continue
        what = {"output_tokens_per_s": "throughput", "output_tokens_per_cpu_s": "tokens per CPU-second",
                "ttft_p99": "p99 TTFT lower by"}[r["metric"]]
        value = "-" if r["value"] is None else f"{r['value']:.2f}x"
        goal = "" if r["goal"] is None else f"   goal >= {r['goal']:g}x: {'met' if r['met'] else 'NOT met'}"
        if r["metric"] == "ttft_p99":
            lines.append(f"{r['offered']:>8}  {r['a']} vs {r['b']}: {what} {value}{goal}")
        else:
            lines.append(f"{r['offered']:>8}  {r['a']} / {r['b']} {what}: {value}{goal}")
    return "\n".join(lines)


def median_roofline(roofs: list):
    """The roofline of the median repeat (by tokens/s; the lower middle for an even count)."""
    return sorted(roofs, key=lambda r: r.output_tokens_per_s)[(len(roofs) - 1) // 2]


def efficiencies(runs: list[dict], roofs: list) -> dict[str, float]:
    """"name @ offered" -> its runs' tokens/s over the roofline's (`pdq.bench.roofline`), each run
    over the roofline timed in its own repeat (`roofs[k]`: repeat k's; a repeat without one takes
    the last), the median over the repeats: side by side, as every other ratio of the run."""
    shares: dict[str, list[float]] = {}
    for r in runs:
        rate = roofs[min(r.get("repeat", 0), len(roofs) - 1)].output_tokens_per_s
        shares.setdefault(f"{r['name']} @ {r['arrivals']}", []).append(r["output_tokens_per_s"] / rate if rate else 0.0)
    return {name: round(statistics.median(s), 3) for name, s in shares.items()}


def roofline_lines(runs: list[dict], roofs: list) -> str:
    roof = median_roofline(roofs)
    each = f"; repeats {', '.join(f'{r.output_tokens_per_s:.1f}' for r in roofs)}" if len(roofs) > 1 else ""
    lines = [f"matrix-multiply roofline (the workload's GEMMs alone, timed here in each repeat beside its runs): "
             f"{roof.output_tokens_per_s:.1f} output tok/s ({roof.seconds:.2f} s, {roof.passes} passes{each})"]
    lines += [f"  {name}: {eff:.0%} of the roofline" for name, eff in efficiencies(runs, roofs).items()]
    if len(roofs) > 1:
        lines.append("  (each run over its own repeat's roofline, the median over the repeats)")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str | None:
    """The first GPU's name, from torch when this process loaded it, else from nvidia-smi."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def machine() -> dict:
    """The machine a run measured: CPU model, vector units (`pdq.ops.cpu.cpu_units`) and count, GPU
    (None: none), Python and torch."""
    from pdq.ops.cpu import cpu_flags, cpu_units

    info = {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "cpu_units": cpu_units(cpu_flags()), "gpu": _gpu(),
            "platform": platform.platform(), "python": platform.python_version()}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    else:
        try:
            info["torch"] = metadata.version("torch")
        except metadata.PackageNotFoundError:
            pass
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


# Variables that change what a run measures without a flag (the model runtime's switches): the
# command a document records starts with those set, so that it reproduces the run.
RECORDED_ENV = ("PDQ_NO_FUSED_OPS", "PDQ_NO_CPU_KERNEL", "PDQ_CUDA_GRAPHS")


def env_prefix() -> list[str]:
    """`NAME=value` of each RECORDED_ENV variable set in this process."""
    return [f"{name}={shlex.quote(os.environ[name])}" for name in RECORDED_ENV if name in os.environ]


def document(runs: list[dict], config: dict, argv: list[str] | None) -> dict:
    """The `--json` document: {"runs": [...], "ratios": [...], "config", "machine", "command", ...}."""
    return {"schema": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": None if argv is None else " ".join([*env_prefix(), "pdq", "bench", *argv]), "config": config,
            "machine": machine(), "runs": runs, "ratios": ratios(runs)}


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
