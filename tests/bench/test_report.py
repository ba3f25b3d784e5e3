"""The --json schema other tools read, the ratios with the issues' goals, the flags."""

import argparse
import json

import pytest

from pdq.bench import report
from pdq.bench.arrivals import Arrivals
from pdq.bench.metrics import summarize
from pdq.bench.options import BenchOptions, add_arguments
from pdq.bench.plot import plot
from tests.bench.conftest import make_record, make_run

LATENCY_KEYS = {"p50", "p90", "p99"}


def run_entry(name: str, tokens_per_req: int, ttft: float, arrivals: Arrivals = Arrivals()) -> dict:
    recs = [make_record(0.0, [ttft + 0.01 * i for i in range(tokens_per_req)]) for _ in range(4)]
    return summarize(make_run(recs, name=name, arrivals=arrivals))


def check_schema(doc: dict) -> None:
    """What issue 8 promises to other tools."""
    assert isinstance(doc["runs"], list) and doc["runs"]
    for r in doc["runs"]:
        for key, kind in (("name", str), ("strategy", str), ("workload", str), ("offered", dict),
                          ("output_tokens_per_s", float), ("requests_per_s", float), ("goodput", float)):
            assert isinstance(r[key], kind), key
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert LATENCY_KEYS <= set(r[key]), key
        assert set(r["offered"]) == {"arrivals", "rate_per_s", "concurrency"}


def test_document_schema_and_ratios(tmp_path):
    runs = [run_entry("static", 10, 2.0), run_entry("continuous", 10, 0.1), run_entry("engine", 10, 0.1),
            run_entry("hf", 10, 3.0)]
    # throughput: the same tokens, in less time for the faster TTFT
    doc = report.document(runs, {"model": "builtin"}, ["--spawn"])
    path = tmp_path / "bench.json"
    report.write_json(path, doc)
    doc = json.loads(path.read_text())
    check_schema(doc)
    assert doc["command"] == "pdq bench --spawn" and doc["machine"]["cpus"] >= 1
    assert [r["name"] for r in doc["runs"]] == ["static", "continuous", "engine", "hf"]
    got = {(r["a"], r["b"], r["metric"]): r for r in doc["ratios"]}
    tput = got["continuous", "static", "output_tokens_per_s"]
    assert tput["value"] == pytest.approx(2.09 / 0.19, rel=1e-2) and tput["goal"] == 3.0 and tput["met"]
    ttft = got["continuous", "static", "ttft_p99"]  # static's p99 TTFT / continuous's
    assert ttft["value"] == pytest.approx(20.0) and ttft["goal"] == 10.0 and ttft["met"]
    assert got["continuous", "hf", "output_tokens_per_s"]["goal"] == 2.4
    assert got["continuous", "engine", "output_tokens_per_s"]["value"] == pytest.approx(1.0)
    assert got["static", "hf", "output_tokens_per_s"]["goal"] is None  # goals are for the default strategy
    text = report.table(runs) + report.ratio_lines(doc["ratios"])
    assert "continuous" in text and "goal >= 3x: met" in text


def test_cpu_table_and_tokens_per_cpu_second():
    service = make_run([make_record(0.0, [0.5, 1.0])], client_cpu_s=0.1)
    service.server_cpu_s = {"decode-0": 0.7, "gateway": 0.2}
    baseline = make_run([make_record(0.0, [0.5, 1.0])], name="engine", client_cpu_s=1.6)
    baseline.server_cpu_s = {}
    target = make_run([make_record(0.0, [0.5, 1.0])], client_cpu_s=0.1)  # --target: server CPU unknown
    runs = [summarize(service), summarize(baseline), summarize(target)]
    assert [r["output_tokens_per_cpu_s"] for r in runs] == [2.0, 1.25, None]
    assert runs[0]["server_cpu_pct"] == {"decode-0": 70.0, "gateway": 20.0} and runs[1]["server_cpu_pct"] is None
    lines = report.cpu_table(runs).splitlines()
    assert lines[1].split() == ["run", "@", "offered", "decode-0", "gateway", "bench", "total"]
    assert lines[2].split()[-4:] == ["70", "20", "10", "100"] and lines[3].split()[-2:] == ["160", "160"]
    assert report.cpu_table(runs[2:]) == ""


def test_prefix_lines_show_what_each_run_found_in_its_cache():
    cached = make_run([make_record(0.0, [0.5, 1.0])])
    cached.notes["prefix_cache"] = {"queried_tokens": 4000, "hit_tokens": 3000}
    target = make_run([make_record(0.0, [0.5, 1.0])], name="target")  # a --target cluster: not read
    runs = [summarize(cached), summarize(target)]
    assert runs[0]["prefix_cache"] == {"queried_tokens": 4000, "hit_tokens": 3000}
    lines = report.prefix_lines(runs).splitlines()
    assert lines[0].startswith("prefix cache") and len(lines) == 2
    assert lines[1].split()[-4:] == ["3,000", "/", "4,000", "(75%)"]
    assert report.prefix_lines(runs[1:]) == ""


def test_ratios_pair_runs_at_the_same_offered_load():
    runs = [run_entry("continuous", 5, 0.1, Arrivals(rate=2.0)), run_entry("static", 5, 0.5, Arrivals(rate=4.0)),
            run_entry("hf", 5, 1.0)]
    assert report.ratios(runs) == []


def test_median_repeats_keeps_the_median_run_of_each_system():
    runs = [dict(run_entry(name, 10, ttft), repeat=i) for i, ttfts in enumerate(((0.1, 1.0), (0.3, 2.0), (0.2, 3.0)))
            for name, ttft in zip(("continuous", "static"), ttfts)]
    merged = report.median_repeats(runs)
    assert [r["name"] for r in merged] == ["continuous", "static"]
    assert merged[0]["repeat"] == 2 and merged[0]["ttft_ms"]["p99"] == pytest.approx(200.0)
    assert merged[1]["repeat"] == 1 and merged[1]["repeats"]["n"] == 3
    assert merged[1]["repeats"]["ttft_p99_ms"] == pytest.approx([1000.0, 2000.0, 3000.0])
    assert report.median_repeats(runs[:2]) == runs[:2]


def test_plot_writes_a_png(tmp_path):
    runs = [run_entry(name, 5, ttft, Arrivals(rate=rate)) for name, ttft in (("continuous", 0.1), ("static", 1.0))
            for rate in (1.0, 2.0)] + [run_entry("hf", 5, 2.0)]
    plot(runs, tmp_path / "p.png", title="t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def options(*argv: str) -> BenchOptions:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return BenchOptions.from_args(parser.parse_args(list(argv)))


def test_options():
    o = options("--spawn", "--rates", "1,inf", "--env", "PDQ_STRATEGY_BATCH_SIZE=4", "--baseline", "hf")
    assert o.strategies == ("static", "dynamic", "continuous") and o.baselines == ("hf",)
    assert [a.label for a in o.loads] == ["1/s", "all"] and o.env == {"PDQ_STRATEGY_BATCH_SIZE": "4"}
    assert options("--target", "h:1").strategies == ("target",)
    assert [a.label for a in options("--target", "h:1", "--concurrency", "2,4").loads] == ["C=2", "C=4"]
    keyed = options("--target", "h:1", "--api-key", "k", "--tenant-key", "flood=f")
    assert keyed.api_key("flood") == "f" and keyed.api_key("steady") == "k"
    assert options("--baseline", "engine").loads == (Arrivals(),) and options("--spawn", "--repeat", "3").repeat == 3
    # as `pdq up`: colocated workers unless --separate
    assert options("--spawn").colocate and options("--spawn", "--colocate").colocate
    assert not options("--spawn", "--separate").colocate
    assert options("--spawn").doors == ("grpc",) and options("--spawn", "--doors", "grpc,http").doors == ("grpc", "http")
    # --dtype: the spawned workers' (their environment), and the baselines' and the roofline's (opts.dtype)
    typed = options("--spawn", "--dtype", "bfloat16", "--baseline", "engine")
    assert typed.dtype == "bfloat16" and typed.env == {"PDQ_DTYPE": "bfloat16"}
    assert options("--spawn").dtype is None and "PDQ_DTYPE" not in options("--spawn").env
    for bad, match in ((["--spawn", "--target", "h:1"], "not both"), ([], "nothing to measure"),
                       (["--spawn", "--strategies", "fast"], "unknown fast"),
                       (["--target", "h:1", "--strategies", "a,b"], "one label"),
                       (["--spawn", "--env", "X"], "KEY=VALUE"),
                       (["--spawn", "--env", "PDQ_STRATEGY=x"], "--strategies"),
                       (["--spawn", "--env", "PDQ_DTYPE=bfloat16"], "--dtype"),
                       (["--spawn", "--rates", "0"], "rates"), (["--spawn", "--repeat", "0"], "--repeat"),
                       (["--spawn", "--doors", "grpc,smtp"], "--doors"), (["--spawn", "--doors", ""], "--doors"),
                       (["--target", "h:1", "--doors", "http"], "with --spawn")):
        with pytest.raises(ValueError, match=match):
            options(*bad)


def test_prefix_lines_show_what_separate_workers_hand_offs_carried_and_left_out():
    run = make_run([make_record(0.0, [0.5, 1.0])], name="continuous")
    run.notes["prefix_cache"] = {"queried_tokens": 4000, "hit_tokens": 3000, "handoff_bytes": 2_500_000,
                                 "handoff_skipped_tokens": 2900}
    (line,) = report.prefix_lines([summarize(run)]).splitlines()[1:]
    assert line.endswith("hand-offs carried 2.5 MB of K/V and left out 2,900 prompt positions the decode worker held")


def test_the_recorded_command_starts_with_the_runtime_switches_set_in_the_environment(monkeypatch):
    for name in report.RECORDED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert report.document([], {}, ["--spawn"])["command"] == "pdq bench --spawn"
    monkeypatch.setenv("PDQ_NO_FUSED_OPS", "1")
    monkeypatch.setenv("PDQ_REDIS_URL", "redis://:secret@h:6379/0")  # not a runtime switch: not recorded
    assert report.document([], {}, ["--spawn"])["command"] == "PDQ_NO_FUSED_OPS=1 pdq bench --spawn"


def test_each_run_is_a_share_of_the_roofline_timed_in_its_own_repeat():
    from pdq.bench.roofline import Roofline

    # the machine slowed in repeat 2: its roofline and its run alike
    roofs = [Roofline(1.0, 100, 5), Roofline(2.0, 100, 5), Roofline(1.0, 100, 5)]  # 100, 50, 100 tok/s
    runs = [{"name": "engine", "arrivals": "all", "repeat": k, "output_tokens_per_s": v}
            for k, v in enumerate([80.0, 45.0, 90.0])]
    runs.append({"name": "continuous", "arrivals": "all", "repeat": 0, "output_tokens_per_s": 70.0})
    # engine: 0.8, 0.9, 0.9 -> 0.9 (over one roofline of 100 tok/s its median run would say 0.8);
    # a system run in fewer repeats than were timed takes its own repeats' rooflines
    assert report.efficiencies(runs, roofs) == {"engine @ all": 0.9, "continuous @ all": 0.7}
    assert report.median_roofline(roofs).output_tokens_per_s == 100
    lines = report.roofline_lines(runs, roofs)
    assert "repeats 100.0, 50.0, 100.0" in lines and "engine @ all: 90% of the roofline" in lines
    # a repeat the invocation stopped in before its roofline: the last roofline timed
    late = {"name": "engine", "arrivals": "all", "repeat": 3, "output_tokens_per_s": 95.0}
    assert report.efficiencies([late], roofs) == {"engine @ all": 0.95}
