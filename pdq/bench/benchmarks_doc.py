"""BENCHMARKS.md and its plots, rendered from the result JSON checked in under benchmarks/ and
the section descriptions in benchmarks/sections.yaml: `make benchmarks`, or
`python -m pdq.bench.benchmarks_doc` (`--check` exits 1 when a file is stale instead).

Every figure in the report is read from a JSON file; the YAML says which, and what the text
around it is. A value is named by a reference "FILE:RUN:PATH": FILE under benchmarks/; RUN a
run's name in the document's "runs" (optionally "NAME@ARRIVALS"), or empty for the document
itself; PATH dotted keys (and list indexes) inside it, "*" for every value of a mapping, e.g.
"cpu/mixed.json:continuous:ttft_ms.p99" or "cpu/scheduler.json::scheduler.ttft_light.ratio".
"""

import argparse
import re
import sys
from pathlib import Path

import yaml

from pdq.bench.benchmarks_tables import (BASELINES, DocError, Docs, capacity_panels, capacity_table, chaos_command,
                                         chaos_panels, chaos_table, md_table, roofline_lines, run_label, runs_table)
from pdq.bench.svgbars import Bar, Panel, svg

ROOT = Path(__file__).resolve().parents[2]  # the checkout: BENCHMARKS.md and benchmarks/


def anchor(title: str) -> str:
    """The id GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


# -- figures: one number each, from one or two references -----------------------------------

OPS = {"value": lambda a, b: a, "ratio": lambda a, b: a / b, "inverse": lambda a, b: b / a,
       "diff": lambda a, b: a - b}


def values(docs: Docs, spec: dict) -> list[float]:
    """The figure's values: `op` of the references `a` and `b`, pair by pair (a reference may be
    a list of references, or name several values with ".*")."""
    op = OPS[spec.get("op", "value")]

    def refs(r: str | list[str]) -> list[float]:
        return [v for x in (r if isinstance(r, list) else [r]) for v in docs.values(x)]

    a = refs(spec["a"])
    b = refs(spec["b"]) if "b" in spec else [None] * len(a)
    if len(a) != len(b):
        raise DocError(f"{spec.get('what') or spec.get('label')!r}: {len(a)} values against {len(b)}")
    return [op(x, y) for x, y in zip(a, b)]


def figure(docs: Docs, spec: dict) -> tuple[str, str, bool | None]:
    """-> (the figure as text, the goal as text, met: None without a goal; with several
    values, met by all). A value above `impossible: {above, why}` says the measurement went
    wrong: the figure then carries `why` and is neither met nor not."""
    vs = values(docs, spec)
    fmt = spec.get("fmt", "{:,.2f}")
    text = ", ".join(fmt.format(v) for v in vs)
    goal = spec.get("goal") or {}
    if "min" in goal:
        goal_text, met = ">= " + fmt.format(goal["min"]), all(v >= goal["min"] for v in vs)
    elif "max" in goal:
        goal_text, met = "<= " + fmt.format(goal["max"]), all(v <= goal["max"] for v in vs)
    elif "range" in goal:
        lo, hi = goal["range"]
        goal_text, met = f"{fmt.format(lo)} .. {fmt.format(hi)}", all(lo <= v <= hi for v in vs)
    else:
        goal_text, met = "", None
    bad = spec.get("impossible")
    if bad and any(v > bad["above"] for v in vs):
        return f"{text}: {bad['why']}", goal_text, None
    return text, goal_text, met


def _met(met: bool | None) -> str:
    return "" if met is None else ("met" if met else "**not met**")


def figures_table(docs: Docs, specs: list[dict]) -> list[str]:
    rows = [(s["what"], *figure(docs, s)) for s in specs]
    if not any(goal for _, _, goal, _ in rows):
        return md_table(["what", "figure"], [[w, v] for w, v, _, _ in rows])
    return md_table(["what", "figure", "goal", ""], [[w, v, g, _met(m)] for w, v, g, m in rows])


# -- the machine and the command of each file -----------------------------------------------

def machine_line(doc: dict, note: str = "") -> str:
    m = doc.get("machine") or {}
    units = f" ({', '.join(m['cpu_units'])})" if m.get("cpu_units") else ""
    parts = [(m.get("cpu_model") or "CPU model not recorded") + units,
             f"{m['cpus']} CPUs" if m.get("cpus") else "CPU count not recorded",
             ("no GPU" if m["gpu"] is None else m["gpu"]) if "gpu" in m else "GPU not recorded",
             f"torch {m['torch']}" if m.get("torch") else "torch version not recorded",
             f"Python {m['python']}" if m.get("python") else ""]
    line = ", ".join(p for p in parts if p)
    return f"{line} ({note})" if note else line


def machine_lines(docs: Docs, files: dict[str, str], note: str) -> list[str]:
    """One line per distinct machine, naming the files measured on it."""
    groups: dict[str, list[str]] = {}
    for name in files:
        groups.setdefault(machine_line(docs.doc(name), note), []).append(name)
    if len(groups) == 1:
        return [f"**Machine**: {next(iter(groups))}."]
    return ["**Machines**:"] + [f"- {line}: " + ", ".join(f"`{n}`" for n in names) for line, names in groups.items()]


def commands_block(docs: Docs, files: dict[str, str], given: dict[str, str]) -> list[str]:
    """The command that wrote each file: the one the JSON recorded, else the section's."""
    lines = []
    for name in files:
        command = docs.doc(name).get("command") or chaos_command(docs.doc(name)) or given.get(name)
        if not command:
            raise DocError(f"benchmarks/{name} records no command and its section gives none")
        lines.append(f"{command}    # -> benchmarks/{name}")
    return ["```sh", *lines, "```"]


# -- plots -----------------------------------------------------------------------------------

def plot_panels(docs: Docs, section: dict) -> list[Panel]:
    """Each panel of `plot` is either {title, runs: PATH} (a bar per run of the section's files)
    or {title, bars: [{label, ref | figure}]}."""
    files = section.get("files") or {}
    panels = []
    for p in section.get("plot") or []:
        if p.get("capacity"):
            panels += capacity_panels(docs, files)
        elif p.get("chaos"):
            panels += chaos_panels(docs, files)
        elif "runs" in p:
            bars = []
            for name, label in files.items():
                for r in docs.doc(name).get("runs", []):
                    ref = f"{name}:{r['name']}@{r['arrivals']}:{p['runs']}"
                    v = docs.value(ref)
                    bars.append(Bar(run_label(label, r), v, p.get("fmt", "{:,.0f}").format(v),
                                    "alt" if r["name"] in BASELINES else ""))
            panels.append(Panel(p["title"], tuple(bars)))
        else:
            bars = []
            for b in p["bars"]:
                spec = {"fmt": p.get("fmt", "{:,.0f}"), **(b if "a" in b else {"a": b["ref"]})}
                text, _, met = figure(docs, spec)
                v = values(docs, spec)[0]
                bars.append(Bar(b["label"], v, text, "" if met is None else ("good" if met else "bad")))
            panels.append(Panel(p["title"], tuple(bars)))
    return panels


# -- the report ------------------------------------------------------------------------------

def section_lines(docs: Docs, section: dict, plot_name: str | None) -> list[str]:
    files = section.get("files") or {}
    out = [f"## {section['title']}", "", section["text"].strip(), ""]
    if files:
        out += machine_lines(docs, files, section.get("machine_note", "")) + [""]
        out += commands_block(docs, files, section.get("commands") or {}) + [""]
    elif section.get("commands"):
        out += ["```sh", *section["commands"], "```", ""]
    kind = section.get("kind", "runs" if files else "text")
    if kind == "runs":
        out += runs_table(docs, files) + [""]
        roof = roofline_lines(docs, files)
        out += roof + ([""] if roof else [])
    elif kind == "capacity":
        out += capacity_table(docs, files) + [""]
    elif kind == "chaos":
        out += chaos_table(docs, files) + [""]
    if section.get("figures"):
        out += figures_table(docs, section["figures"]) + [""]
    if section.get("after"):
        out += [section["after"].strip(), ""]
    if plot_name:
        out += [f"![{section['title']}](benchmarks/plots/{plot_name})", ""]
    return out


def top_table(docs: Docs, sections: list[dict]) -> list[str]:
    """Every figure marked `top`, linking to its section."""
    rows = []
    for s in sections:
        for f in s.get("figures") or []:
            if f.get("top"):
                text, goal, met = figure(docs, f)
                rows.append([f"[{f['what']}](#{anchor(s['title'])})", text, goal, _met(met)])
    return md_table(["what", "figure", "goal", ""], rows)


def render(root: Path = ROOT) -> dict[Path, str]:
    """-> {path: text} of BENCHMARKS.md and every plot."""
    bench = root / "benchmarks"
    spec = yaml.safe_load((bench / "sections.yaml").read_text())
    docs = Docs(bench)
    out: dict[Path, str] = {}
    lines = [f"# {spec['title']}", "", "<!-- Generated by `make benchmarks` (python -m pdq.bench.benchmarks_doc) from "
             "benchmarks/sections.yaml and the JSON under benchmarks/; edit those, not this file. -->", "",
             spec["intro"].strip(), "", *top_table(docs, spec["sections"]), ""]
    for section in spec["sections"]:
        panels = plot_panels(docs, section)
        plot_name = f"{section['id']}.svg" if panels else None
        if plot_name:
            out[bench / "plots" / plot_name] = svg(panels)
        lines += section_lines(docs, section, plot_name)
    out[root / "BENCHMARKS.md"] = "\n".join(lines).rstrip() + "\n"
    return out


def stale(root: Path = ROOT) -> list[Path]:
    """Files that differ from a fresh rendering, and plots no section draws any more."""
    want = render(root)
    bad = [p for p, text in want.items() if not p.is_file() or p.read_text() != text]
    return bad + sorted(p for p in (root / "benchmarks" / "plots").glob("*.svg") if p not in want)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdq.bench.benchmarks_doc", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    args = p.parse_args(argv)
    try:
        if args.check:
            bad = stale()
            for path in bad:
                print(f"stale: {path.relative_to(ROOT)}", file=sys.stderr)
            return 1 if bad else 0
        want = render()
    except (DocError, KeyError, OSError, yaml.YAMLError) as exc:
        print(f"benchmarks_doc: {exc!r}", file=sys.stderr)
        return 2
    (ROOT / "benchmarks" / "plots").mkdir(exist_ok=True)
    for old in (ROOT / "benchmarks" / "plots").glob("*.svg"):
        if old not in want:
            old.unlink()
    for path, text in want.items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
