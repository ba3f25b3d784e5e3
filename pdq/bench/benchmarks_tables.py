"""The result JSON under benchmarks/ (`Docs`: each file read once, values by reference) and the
tables and plot panels drawn from each kind of file: `pdq bench` runs, `--capacity` sweeps,
`pdq chaos` runs. Used by pdq.bench.benchmarks_doc."""

import json
from dataclasses import dataclass
from pathlib import Path

from pdq.bench.svgbars import Bar, Panel

BASELINES = ("hf", "engine")


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


class DocError(ValueError):
    """A section names a file, run or key its JSON does not have."""


def num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


@dataclass
class Docs:
    """The JSON documents under `root`, each read once."""

    root: Path

    def __post_init__(self) -> None:
        self._cache: dict[str, dict] = {}

    def doc(self, name: str) -> dict:
        if name not in self._cache:
            path = self.root / name
            if not path.is_file():
                raise DocError(f"no result file benchmarks/{name}")
            self._cache[name] = json.loads(path.read_text())
        return self._cache[name]

    def run(self, name: str, run: str) -> dict:
        want, _, arrivals = run.partition("@")
        found = [r for r in self.doc(name).get("runs", [])
                 if r["name"] == want and (not arrivals or r["arrivals"] == arrivals)]
        if len(found) != 1:
            raise DocError(f"benchmarks/{name}: {len(found)} runs named {run!r}")
        return found[0]

    def value(self, ref: str) -> float:
        found = self.values(ref)
        if len(found) != 1:
            raise DocError(f"{ref!r} names {len(found)} values, not one")
        return found[0]

    def values(self, ref: str) -> list[float]:
        """The numbers a reference names: one, or with "*" in PATH one per value of that
        mapping (in key order)."""
        try:
            name, run, path = ref.split(":", 2)
        except ValueError:
            raise DocError(f"{ref!r} is not FILE:RUN:PATH") from None
        nodes = [self.run(name, run) if run else self.doc(name)]
        for key in path.split(".") if path else []:
            try:
                if key == "*":
                    nodes = [n[k] for n in nodes for k in sorted(n)]
                else:
                    nodes = [n[int(key)] if isinstance(n, list) else n[key] for n in nodes]
            except (KeyError, IndexError, ValueError, TypeError):
                raise DocError(f"{ref!r}: no {key!r}") from None
        for v in nodes:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise DocError(f"{ref!r} is {v!r}, not a number")
        return nodes


# -- tables of `pdq bench` runs --------------------------------------------------------------

def run_label(label: str, run: dict) -> str:
    name = f"{run['name']} @ {run['arrivals']}"
    return f"{label}: {name}" if label else name


def _cpu_total(run: dict) -> float | None:
    if run.get("client_cpu_pct") is None:
        return None
    return sum((run.get("server_cpu_pct") or {}).values()) + run["client_cpu_pct"]


def _throughput(run: dict) -> str:
    reps = (run.get("repeats") or {}).get("output_tokens_per_s")
    main = num(run["output_tokens_per_s"], 1)
    return f"{main} ({', '.join(num(x, 1) for x in reps)})" if reps else main


def _pair(d: dict, a: str = "p50", b: str = "p99") -> str:
    return f"{num(d.get(a))} / {num(d.get(b))}"


def runs_table(docs: Docs, files: dict[str, str]) -> list[str]:
    """One row per run of every file: throughput (each repeat's, the median's first), latency
    percentiles, CPU (and output tokens per CPU-second), the machine's load average as the run
    began; prefix-cache hits where a run found any, and the share of prompt positions whose K/V
    hand-offs left out (the decode worker held them) where any did."""
    entries = [(label, r) for name, label in files.items() for r in docs.doc(name).get("runs", [])]
    prefix = any((r.get("prefix_cache") or {}).get("hit_tokens") for _, r in entries)
    skips = any((r.get("prefix_cache") or {}).get("handoff_skipped_tokens") for _, r in entries)
    head = ["run", "ok", "out tok/s (repeats)", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "e2e p50 / p99 ms",
            "CPU, % of a core", "tok / CPU-s", "load avg before"] + (["prefix cache hits"] if prefix else []) + (
            ["prompt positions hand-offs left out"] if skips else [])
    rows = []
    for label, r in entries:
        row = [run_label(label, r), f"{r['completed']}/{r['requests']}", _throughput(r), _pair(r["ttft_ms"]),
               _pair(r["itl_ms"]), _pair(r["e2e_ms"]), num(_cpu_total(r)), num(r.get("output_tokens_per_cpu_s")),
               num(r.get("loadavg_1m_before"), 1)]
        if prefix:
            pc = r.get("prefix_cache") or {}
            row.append(f"{pc['hit_tokens'] / pc['queried_tokens']:.0%}" if pc.get("queried_tokens") else "-")
        if skips:
            pc = r.get("prefix_cache") or {}
            row.append(f"{pc.get('handoff_skipped_tokens', 0) / pc['queried_tokens']:.0%}" if pc.get("queried_tokens")
                       else "-")
        rows.append(row)
    return md_table(head, rows)


def roofline_lines(docs: Docs, files: dict[str, str]) -> list[str]:
    out = []
    for name, label in files.items():
        roof = docs.doc(name).get("roofline")
        if roof:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in roof["efficiency"].items())
            who = f"{label} " if label else ""
            each = roof.get("repeats", [])
            timed = (f"the median of {len(each)}, one timed in each repeat: "
                     f"{', '.join(num(r['output_tokens_per_s'], 1) for r in each)}; a run's share is of its own "
                     f"repeat's roofline, a system's the median over its repeats" if len(each) > 1
                     else f"{roof['seconds']:.2f} s for the workload")
            out.append(f"- {who}matrix-multiply roofline (`benchmarks/{name}`): "
                       f"{num(roof['output_tokens_per_s'], 1)} output tok/s ({timed}); "
                       f"reached: {shares}")
    return out


# -- control-plane capacity sweeps (`pdq bench --capacity`) ----------------------------------

def _cpu_cell(cpu: dict) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))


def _capacity_row(label: str, s: dict) -> list[str]:
    best, broken = s.get("best"), s.get("first_broken")
    brk = f"{num(broken['offered_rps'])}/s offered: {broken['why']}" if broken else "-"
    if not best:
        return [label, str(s["max_tokens"]), "none: the first step broke", *["-"] * 4, brk]
    cpu_ms = sum(best["cpu_pct"].values()) * 10 / best["requests_per_s"]
    return [label, str(s["max_tokens"]), f"{num(best['requests_per_s'])} ({num(best['offered_rps'])})",
            num(best["tokens_per_s"]), num(best["p99_ms"]), f"{cpu_ms:.1f}", _cpu_cell(best["cpu_pct"]), brk]


def capacity_table(docs: Docs, files: dict[str, str]) -> list[str]:
    head = ["run", "max_tokens", "best sustained req/s (offered)", "streamed tok/s", "p99 submit->done ms",
            "CPU ms / request (all processes)", "CPU at the best step, % of a core", "first broken step"]
    rows, notes = [], []
    for name, label in files.items():
        doc = docs.doc(name)
        for s in doc["sweeps"]:
            rows.append(_capacity_row(label or name, s))
            if s.get("ceiling"):
                rows.append(_capacity_row(f"{label or name}, bare gRPC server", s["ceiling"]))
            if s.get("share_of_ceiling"):
                sh = s["share_of_ceiling"]
                notes.append(f"- {label or name}, max_tokens {s['max_tokens']}: pdq / the bare gRPC server "
                             f"{sh['requests_per_s']:.2f}x req/s, {sh['tokens_per_s']:.2f}x streamed tok/s")
            if s.get("redis_ceiling_rps"):
                notes.append(f"- {label or name}, max_tokens {s['max_tokens']}: at Redis's CPU per request of the "
                             f"best step, Redis alone on one core would carry ~{num(s['redis_ceiling_rps'])} req/s")
        rb = doc.get("redis_benchmark") or {}
        if rb:
            notes.append(f"- {label or name}: `redis-benchmark` SET on the same server: "
                         f"{num(rb.get('set_per_s_pipeline_1'))}/s one per round trip, "
                         f"{num(rb.get('set_per_s_pipeline_16'))}/s pipelined 16 deep")
    table = md_table(head, rows)
    return table + ([""] + notes if notes else [])


def capacity_panels(docs: Docs, files: dict[str, str]) -> list[Panel]:
    panels = []
    for name, label in files.items():
        for s in docs.doc(name)["sweeps"]:
            steps = sorted(s["steps"], key=lambda st: st["offered_rps"])
            bars = tuple(Bar(f"offered {st['offered_rps']:,.0f}/s", st["achieved_rps"],
                             f"{st['achieved_rps']:,.0f} req/s, p99 {st['p99_ms']:,.0f} ms",
                             "bad" if st["broke"] else "") for st in steps)
            panels.append(Panel(f"{label or name}, max_tokens {s['max_tokens']}: completed req/s per step "
                                "(red: the step broke)", bars))
    return panels


# -- fault runs (`pdq chaos`, its chaos.json) ------------------------------------------------

CHAOS_FLAGS = ("requests", "concurrency", "seed", "cancels", "worker_kills", "redis_restarts", "redis_down_s",
               "conn_drops", "scheduler_kills", "gateway_kills", "corrupt_handoffs", "model")


def chaos_command(doc: dict) -> str | None:
    """The options a chaos.json records, as the flags of an equivalent `pdq chaos`."""
    opts = doc.get("options")
    if not opts:
        return None
    flags = [f"--{k.replace('_', '-')} {opts[k]:g}" if isinstance(opts[k], float)
             else f"--{k.replace('_', '-')} {opts[k]}" for k in CHAOS_FLAGS if opts.get(k) is not None]
    return " ".join(["pdq chaos", *flags])


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {num(v)}" for k, v in d.items()) or "none"


def chaos_table(docs: Docs, files: dict[str, str]) -> list[str]:
    head = ["run", "accepted / planned", "faults struck", "ended as", "checks", "TTFT p50 / p99 ms (completed)",
            "e2e p50 / p99 ms", "wall s"]
    rows = []
    for name, label in files.items():
        d = docs.doc(name)
        req, lat = d["requests"], d["latency_ms"]
        failed = [c for c, v in d["checks"].items() if not v["ok"]]
        checks = (f"all {len(d['checks'])} passed" if not failed
                  else "**failed**: " + ", ".join(f"{c} ({d['checks'][c]['violations']})" for c in failed))
        rows.append([label or name, f"{num(req['accepted'])} / {num(req['planned'])}", _counts(d["faults"]["by_kind"]),
                     _counts(req["by_state"]), checks, f"{num(lat['ttft_p50'])} / {num(lat['ttft_p99'])}",
                     f"{num(lat['e2e_p50'])} / {num(lat['e2e_p99'])}", num(d["wall_s"])])
    return md_table(head, rows)


def chaos_panels(docs: Docs, files: dict[str, str]) -> list[Panel]:
    panels = []
    for name, label in files.items():
        d = docs.doc(name)
        bars = [Bar(f"fault: {k}", v, num(v), "alt") for k, v in d["faults"]["by_kind"].items()]
        bars += [Bar(f"ended {k}", v, num(v), "" if k in ("COMPLETED", "CANCELLED", "TIMED_OUT") else "bad")
                 for k, v in d["requests"]["by_state"].items()]
        panels.append(Panel(f"{label or name}: faults struck (grey) and how requests ended", tuple(bars)))
    return panels
