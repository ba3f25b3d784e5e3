"""BENCHMARKS.md and its plots are what benchmarks/sections.yaml and the result JSON under
benchmarks/ render to now; every result file is in a section; links into the report name a
section it has."""

import json
import re

import pytest
import yaml

from pdq.bench import benchmarks_doc
from pdq.bench.benchmarks_doc import anchor, machine_line, render, stale
from pdq.bench.benchmarks_tables import DocError, Docs
from pdq.bench.report import machine
from pdq.ops.cpu import cpu_units

ROOT = benchmarks_doc.ROOT


def test_benchmarks_md_and_its_plots_are_current():
    bad = [str(p.relative_to(ROOT)) for p in stale()]
    assert bad == [], f"stale: {bad}: run `make benchmarks` (python -m pdq.bench.benchmarks_doc)"


def test_every_result_json_under_benchmarks_is_rendered_by_a_section():
    text = (ROOT / "benchmarks" / "sections.yaml").read_text()
    named = set(re.findall(r"([\w-]+/[\w.-]+\.json)", text))
    present = {p.relative_to(ROOT / "benchmarks").as_posix() for p in (ROOT / "benchmarks").rglob("*.json")}
    assert present - named == set(), "result JSON no section renders"
    assert named - present == set(), "sections name result JSON that is not there"


def test_every_link_into_benchmarks_md_names_one_of_its_sections():
    report = (ROOT / "BENCHMARKS.md").read_text()
    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", report, re.M)}
    linked = {}
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md")]:
        for a in re.findall(r"BENCHMARKS\.md#([\w-]+)|\]\(#([\w-]+)\)", path.read_text()):
            if path.name == "BENCHMARKS.md" or a[0]:
                linked[a[0] or a[1]] = path.name
    assert {a: f for a, f in linked.items() if a not in anchors} == {}


def _tiny(tmp_path, figure: dict) -> None:
    (tmp_path / "benchmarks" / "cpu").mkdir(parents=True)
    runs = [{"name": n, "arrivals": "all", "requests": 2, "completed": 2, "output_tokens_per_s": tps,
             "ttft_ms": {"p50": ttft, "p99": ttft + 10}, "itl_ms": {"p50": 1, "p99": 2}, "e2e_ms": {"p50": 3, "p99": 4},
             "client_cpu_pct": 10.0, "server_cpu_pct": {"gateway": 5.0}} for n, tps, ttft in
            (("continuous", 300.0, 50.0), ("engine", 150.0, 200.0))]
    doc = {"command": "pdq bench --spawn", "machine": {"cpus": 2, "cpu_model": "Some CPU", "gpu": None}, "runs": runs}
    (tmp_path / "benchmarks" / "cpu" / "a.json").write_text(json.dumps(doc))
    spec = {"title": "Benchmarks", "intro": "Intro.",
            "sections": [{"id": "a", "title": "The `a` workload", "text": "What it measures.",
                          "files": {"cpu/a.json": ""}, "figures": [figure],
                          "plot": [{"title": "tok/s", "runs": "output_tokens_per_s"}]}]}
    (tmp_path / "benchmarks" / "sections.yaml").write_text(yaml.safe_dump(spec))


def test_a_section_shows_the_machine_the_command_a_table_its_figures_against_their_goals_and_a_plot(tmp_path):
    _tiny(tmp_path, {"what": "continuous / engine", "a": "cpu/a.json:continuous:output_tokens_per_s",
                     "b": "cpu/a.json:engine:output_tokens_per_s", "op": "ratio", "fmt": "{:.2f}x",
                     "goal": {"min": 2.5}, "top": True})
    out = render(tmp_path)
    md = out[tmp_path / "BENCHMARKS.md"]
    assert "| [continuous / engine](#the-a-workload) | 2.00x | >= 2.50x | **not met** |" in md
    assert "**Machine**: Some CPU, 2 CPUs, no GPU, torch version not recorded." in md
    assert "pdq bench --spawn    # -> benchmarks/cpu/a.json" in md
    assert "| continuous @ all | 2/2 | 300.0 | 50 / 60 | 1 / 2 | 3 / 4 | 15 | - | - |" in md
    assert "![The `a` workload](benchmarks/plots/a.svg)" in md
    plot = out[tmp_path / "benchmarks" / "plots" / "a.svg"]
    assert plot.startswith("<svg") and "continuous @ all" in plot and ">300<" in plot
    assert render(tmp_path) == out  # the same input, the same bytes


def test_a_latency_figure_is_the_other_runs_over_this_ones_and_a_wrong_reference_is_an_error(tmp_path):
    _tiny(tmp_path, {"what": "TTFT lower by", "a": "cpu/a.json:continuous:ttft_ms.p50",
                     "b": "cpu/a.json:engine:ttft_ms.p50", "op": "inverse", "fmt": "{:.1f}x", "goal": {"min": 4}})
    assert "| TTFT lower by | 4.0x | >= 4.0x | met |" in render(tmp_path)[tmp_path / "BENCHMARKS.md"]
    docs = Docs(tmp_path / "benchmarks")
    assert docs.values("cpu/a.json:engine:ttft_ms.*") == [200.0, 210.0]  # p50, p99: in key order
    _tiny(tmp_path / "b", {"what": "x", "a": "cpu/a.json:static:output_tokens_per_s"})
    with pytest.raises(DocError, match="0 runs named 'static'"):
        render(tmp_path / "b")


def test_the_json_records_the_machine_cpu_model_and_gpu():
    m = machine()
    assert m["cpu_model"] and "gpu" in m and m["cpus"] >= 1
    assert set(m["cpu_units"]) <= {"AVX2", "AVX-512", "AVX512_BF16", "AMX"}


def test_the_machine_line_names_the_cpus_vector_units_where_recorded():
    m = {"cpus": 2, "cpu_model": "AMD EPYC", "gpu": None, "torch": "2.13.0+cpu"}
    assert machine_line({"machine": {**m, "cpu_units": ["AVX2", "AVX-512", "AVX512_BF16"]}}).startswith(
        "AMD EPYC (AVX2, AVX-512, AVX512_BF16), 2 CPUs, no GPU")
    assert machine_line({"machine": m}).startswith("AMD EPYC, 2 CPUs")  # a document from before the field


def test_cpu_units_names_what_the_flags_hold():
    assert cpu_units(frozenset("fpu sse avx2 fma".split())) == ["AVX2"]
    assert cpu_units(frozenset("avx2 avx512f avx512_bf16 amx_bf16 amx_tile".split())) == [
        "AVX2", "AVX-512", "AVX512_BF16", "AMX"]
    assert cpu_units(frozenset()) == []
