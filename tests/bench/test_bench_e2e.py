"""`pdq bench --spawn` as a user runs it: a real cluster of processes, the tiny built-in model,
both baselines; the JSON has every field and the numbers are sane (no timing thresholds)."""

import json
import subprocess
import sys

import pytest

from tests.bench.test_report import check_schema


def test_pdq_bench_spawn_with_baselines(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "pdq.cli", "bench", "--spawn", "--model", "builtin:tiny", "--strategies", "continuous",
           "--requests", "6", "--baseline", "engine", "--baseline", "hf", "--slo-ttft", "60000",
           "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "continuous" in proc.stdout and "ratios at the same offered load" in proc.stdout

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
    ratios = {(x["a"], x["b"]): x for x in doc["ratios"] if x["metric"] == "output_tokens_per_s"}
    assert ratios["continuous", "hf"]["goal"] == 2.4 and ratios["continuous", "engine"]["goal"] == 0.9
    assert all(x["value"] > 0 for x in ratios.values())
