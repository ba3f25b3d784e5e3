"""The terminal table, the ratios between runs, and the `--json` document.

Speed goals are ratios between runs of the same invocation at the same offered load (this
machine is shared and noisy; absolute numbers move, ratios measured side by side much less).
"""

import json
import os
import platform
import sys
import time
from pathlib import Path

BASELINE_NAMES = ("hf", "engine")
SCHEMA_VERSION = 1

# (a, b, metric, goal) from issues 3 and 8: a ratio of a to b of at least `goal`. For
# "output_tokens_per_s" the ratio is a's / b's; for "ttft_p99" it is b's / a's (a's is lower).
# "service" stands for a run of the whole service with the default (continuous) strategy.
GOALS = (
    ("continuous", "static", "output_tokens_per_s", 3.0),
    ("continuous", "static", "ttft_p99", 10.0),
    ("service", "hf", "output_tokens_per_s", 2.4),
    ("service", "engine", "output_tokens_per_s", 0.9),
)


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _lat(d: dict) -> str:
    return "/".join(_fmt(d.get(k)) for k in ("p50", "p90", "p99"))


def table(runs: list[dict]) -> str:
    """One row per run: throughput first, then latency percentiles (ms), never one blended number."""
    head = ["run", "offered", "ok", "out tok/s", "req/s", "TTFT p50/p90/p99", "ITL p50/p90/p99",
            "e2e p50/p90/p99", "goodput"]
    rows = [[r["name"], r["arrivals"], f"{r['completed']}/{r['requests']}", _fmt(r["output_tokens_per_s"], 1),
             _fmt(r["requests_per_s"], 2), _lat(r["ttft_ms"]), _lat(r["itl_ms"]), _lat(r["e2e_ms"]),
             _fmt(r["goodput"], 2)] for r in runs]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("latencies in ms; goodput in requests/s meeting the SLO" + _slo_note(runs))
    return "\n".join(out)


def _slo_note(runs: list[dict]) -> str:
    slo = runs[0]["slo"] if runs else {}
    parts = [f"TTFT <= {slo['ttft_ms']:g} ms" if slo.get("ttft_ms") else "",
             f"ITL <= {slo['itl_ms']:g} ms" if slo.get("itl_ms") else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else " (no SLO given: every completed request)"


def tenant_table(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        if not r.get("tenants"):
            continue
        lines.append(f"{r['name']} @ {r['arrivals']}: tenant  weight  fair share  share (contended)  tok/s  TTFT p50/p99")
        for name, t in r["tenants"].items():
            lines.append(f"    {name:>10}  {t['weight']:6g}  {t['fair_share']:10.2f}  {t['share']:5.2f} "
                         f"({t['share_contended']:.2f})  {t['output_tokens_per_s']:7.1f}  "
                         f"{_fmt(t['ttft_ms']['p50'])}/{_fmt(t['ttft_ms']['p99'])}")
    return "\n".join(lines)


def kind_table(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        for kind, k in (r.get("kinds") or {}).items():
            lines.append(f"{r['name']} @ {r['arrivals']}: {kind:>6} requests ({k['requests']}): "
                         f"TTFT p50/p90/p99 {_lat(k['ttft_ms'])} ms, e2e {_lat(k['e2e_ms'])} ms")
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
            if a_ok and gb == b["name"] and gm == metric:
                entry["goal"], entry["met"] = goal, value is not None and value >= goal
        out.append(entry)

    for load, named in by_load.items():
        service = [r for n, r in named.items() if n not in BASELINE_NAMES]
        for a in service:
            for b in (named.get("hf"), named.get("engine")):
                if b is not None:
                    add(a, b, "output_tokens_per_s", load)
        for a in service:
            for b in service:
                if a is not b and a["name"] == "continuous":
                    add(a, b, "output_tokens_per_s", load)
                    add(a, b, "ttft_p99", load)
        if "engine" in named and "hf" in named:
            add(named["engine"], named["hf"], "output_tokens_per_s", load)
    return out


def ratio_lines(rs: list[dict]) -> str:
    lines = []
    for r in rs:
        what = ("throughput" if r["metric"] == "output_tokens_per_s" else "p99 TTFT lower by")
        value = "-" if r["value"] is None else f"{r['value']:.2f}x"
        goal = "" if r["goal"] is None else f"   goal >= {r['goal']:g}x: {'met' if r['met'] else 'NOT met'}"
        if r["metric"] == "ttft_p99":
            lines.append(f"{r['offered']:>8}  {r['a']} vs {r['b']}: {what} {value}{goal}")
        else:
            lines.append(f"{r['offered']:>8}  {r['a']} / {r['b']} {what}: {value}{goal}")
    return "\n".join(lines)


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def document(runs: list[dict], config: dict, argv: list[str] | None) -> dict:
    """The `--json` document: {"runs": [...], "ratios": [...], "config", "machine", "command", ...}."""
    return {"schema": SCHEMA_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": None if argv is None else " ".join(["pdq", "bench", *argv]), "config": config,
            "machine": machine(),
            "runs": runs, "ratios": ratios(runs)}


def write_json(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
