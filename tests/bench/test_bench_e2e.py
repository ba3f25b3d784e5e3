"""`pdq bench --spawn` as a user runs it: a real cluster of processes, the tiny built-in model,
both baselines; the JSON has every field and the numbers are sane (no timing thresholds)."""

import json
import subprocess
import sys

import pytest

from pdq.bench.workload import SHARED_PREFIX_TOKENS
from pdq.ops.redis_server import free_port
from pdq.ops.up import Cluster
from tests.bench.test_report import check_schema


def test_pdq_bench_spawn_with_baselines(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--model", "builtin:tiny", "--strategies", "continuous",
           "--requests", "6", "--baseline", "engine", "--baseline", "hf", "--slo-ttft", "60000",
           "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuous" in proc.stdout and "ratios at the same offered load" in proc.stdout
    assert "matrix-multiply roofline" in proc.stdout and "engine @ all: " in proc.stdout

    doc = json.loads(out_json.read_text())
    check_schema(doc)
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert doc["command"].startswith("pdq bench --spawn")
    assert [r["name"] for r in doc["runs"]] == ["continuous", "engine", "hf"]
    expected_tokens = doc["config"]["output_tokens"]
    for r in doc["runs"]:
        assert r["workload"] == "mixed" and r["offered"]["arrivals"] == "all"
        assert r["completed"] == r["requests"] == 6 and r["errors"] == 0 and r["length_mismatches"] == 0
        assert r["output_tokens"] == expected_tokens
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0 and r["goodput"] == r["requests_per_s"]
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            p = r[key]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (r["name"], key, p)
        assert r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["output_tokens_per_s"] * r["duration_s"] == pytest.approx(expected_tokens, rel=1e-2)
    assert doc["runs"][0]["client_cpu_pct"] is not None
    roof = doc["roofline"]
    assert roof["output_tokens_per_s"] > 0 and roof["passes"] > 1
    assert roof["repeats"] == [{k: roof[k] for k in ("seconds", "output_tokens_per_s", "passes")}]  # one repeat
    assert set(roof["efficiency"]) == {"continuous @ all", "engine @ all", "hf @ all"}
    assert all(0 < e for e in roof["efficiency"].values())
    ratios = {(x["a"], x["b"]): x for x in doc["ratios"] if x["metric"] == "output_tokens_per_s"}
    assert ratios["continuous", "hf"]["goal"] == 2.4 and ratios["continuous", "engine"]["goal"] == 0.95
    assert all(x["value"] > 0 for x in ratios.values())


def test_pdq_bench_dtype_runs_the_workers_the_engine_and_the_roofline_in_bfloat16(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--model", "builtin:tiny", "--strategies", "continuous",
           "--requests", "4", "--baseline", "engine", "--dtype", "bfloat16", "--json", str(out_json), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "colocated prefill+decode worker" in proc.stderr and "(bfloat16 on cpu," in proc.stderr  # its start line
    assert "pdq bench: the model in bfloat16 everywhere" in proc.stderr
    doc = json.loads(out_json.read_text())
    assert doc["config"]["dtype"] == "bfloat16"
    engine = next(r for r in doc["runs"] if r["name"] == "engine")
    assert engine["engine"]["dtype"] == "bfloat16"
    assert all(r["completed"] == r["requests"] == 4 and r["errors"] == 0 for r in doc["runs"])
    assert doc["roofline"]["output_tokens_per_s"] > 0


def test_pdq_bench_scheduler_reports_every_goal(tmp_path):
    """`pdq bench --scheduler` on the tiny model: every measurement ran and every goal is printed."""
    out_json = tmp_path / "sched.json"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--scheduler", "--model", "builtin:tiny", "--requests", "3",
           "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())["scheduler"]
    assert report["fairness"]["heavy_requests"] == 30 and report["fairness"]["light_requests"] == 3
    assert 0 < report["fairness"]["dispatched_share_light"] < 1
    assert report["ttft_light"]["alone_p99_ms"] > 0 and report["ttft_light"]["flooded_p99_ms"] > 0
    samples = report["ttft_light"]["flooded_split"]["samples"]  # every light request, to look at the tail
    assert len(samples["ttft_ms"]) == len(samples["queue_ms"]) == len(samples["prefill_ms"]) == 3
    assert report["cancel"]["samples"] == 3 and report["cancel"]["decoding_cancel_to_kv_free_ms_p99"] > 0
    assert len(report["deadline"]["samples"]) == 2
    assert proc.stdout.count("goal ") == 6


def test_pdq_bench_handoff_reports_pdq_against_bare_grpc(tmp_path):
    """`pdq bench --handoff` on the tiny model: real hand-offs over both transports, the bare-gRPC
    ceiling of the same bytes in the same run, the TTFT overhead and the decode split are all reported.
    The decode workers have as many KV slots as a concurrent round takes (4), so every round must
    wait until the previous round's sequences have left the pool, however slow the machine."""
    out_json = tmp_path / "handoff.json"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--handoff", "--model", "builtin:tiny", "--requests", "4",
           "--env", "PDQ_MAX_BATCH_SIZE=4", "--json", str(out_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out_json.read_text())
    for name in ("median", "long"):
        h = report["handoff"][name]
        assert h["kv_bytes"] > 0 and h["grpc"]["push_gbps"] > 0 and h["tcp"]["push_gbps"] > 0
        assert h["bare_grpc"]["gbps"] > 0 and h["bare_grpc"]["pdq_grpc_share"] > 0
    assert report["handoff"]["median"]["tcp"]["concurrent"]["transfers"] == 4
    assert report["ttft"]["prefill_alone_ms"] > 0 and report["ttft"]["tcp"]["handoff_overhead"] > 0
    assert report["decode_split"]["requests"] == 4
    assert "bare grpc.aio stream" in proc.stdout


def test_pdq_bench_reports_prefix_cache_hits_and_each_repeat_starts_cold(tmp_path):
    out_json = tmp_path / "bench.json"
    n = 6
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--model", "builtin:tiny", "--strategies", "continuous",
           "--workload", "shared-prefix", "--requests", str(n), "--baseline", "engine", "--repeat", "2",
           "--no-roofline", "--json", str(out_json), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefix cache (prompt tokens found in it / looked up):" in proc.stdout
    doc = json.loads(out_json.read_text())
    runs = doc["all_runs"]
    assert sorted((r["name"], r["repeat"]) for r in runs) == [("continuous", 0), ("continuous", 1),
                                                              ("engine", 0), ("engine", 1)]
    for r in runs:
        pc = r["prefix_cache"]
        assert pc["queried_tokens"] == doc["config"]["prompt_tokens"]  # every prompt looked up once
        # the system prompt is found for the requests after the first; nothing from an earlier
        # repeat (each repeat's prompts are fresh), so at most n - 1 system prompts' worth
        assert 0 < pc["hit_tokens"] <= (n - 1) * SHARED_PREFIX_TOKENS, (r["name"], r["repeat"], pc)


def test_pdq_bench_offers_a_load_through_both_doors_and_to_any_openai_server(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--model", "builtin:tiny", "--strategies", "continuous",
           "--doors", "grpc,http", "--requests", "6", "--no-roofline", "--json", str(out_json), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert set(runs) == {"continuous", "continuous/http"}
    for r in runs.values():
        assert r["completed"] == 6 and r["errors"] == 0 and r["length_mismatches"] == 0
        assert r["output_tokens"] == doc["config"]["output_tokens"]
    http_vs_grpc = {x["metric"]: x for x in doc["ratios"] if x["a"] == "continuous/http"}
    assert http_vs_grpc["output_tokens_per_s"]["goal"] == 0.95 and http_vs_grpc["output_tokens_per_s"]["value"] > 0
    assert http_vs_grpc["ttft_p50_extra_ms"]["goal"] == 5.0
    assert "continuous/http vs continuous: TTFT p50" in proc.stdout

    with Cluster(model="builtin:tiny", port=0, http_port=free_port()) as cluster:  # any OpenAI-compatible server
        cmd = [sys.executable, "-m", "pdq.cli", "bench", "--target", cluster.base_url, "--model", "builtin:tiny",
               "--api-key", cluster.client_key, "--requests", "4", "--no-roofline", "--no-progress"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "target @ all" in proc.stderr and "4/4 ok" in proc.stderr
    bad = subprocess.run([*cmd[:5], "http://127.0.0.1:9/v1", *cmd[6:]], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "warm-up request failed: HTTP" in bad.stderr
