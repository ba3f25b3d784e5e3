"""`pdq chaos`, short: a real cluster of separate processes on a durable Redis, under a seeded load,
while every role and Redis are killed and restarted, Redis connections dropped and KV hand-offs
corrupted; every check of the checker must pass (the full run: `pdq chaos`, see BENCHMARKS.md)."""

import json
import subprocess
import sys

import pytest

from pdq.chaos.command import chaos
from pdq.chaos.options import FAULT_FLAGS, SHORT, ChaosOptions
from pdq.chaos.report import summary


@pytest.mark.timeout(600)
def test_the_same_load_on_a_cluster_left_alone_passes_every_check(tmp_path):
    # the harness itself: no fault, so any violation is the harness's (or a bug without faults)
    opts = ChaosOptions(**{**SHORT, **{name: 0 for name in FAULT_FLAGS}, "requests": 80, "cancels": 9},
                        out=str(tmp_path))
    result, violations = chaos(opts)
    assert result["ok"], summary(result, violations)
    assert result["requests"]["accepted"] == 80 and result["faults"]["by_kind"] == {}
    assert result["requests"]["cancels"]["asked"] >= 8  # one may end before its cancel is sent
    assert sum(result["requests"]["by_state"].values()) == 80


@pytest.mark.timeout(900)
def test_the_short_chaos_run_loses_duplicates_garbles_stalls_and_leaks_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pdq.cli", "chaos", "--short", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=880)
    result = json.loads((tmp_path / "chaos.json").read_text())
    struck = result["faults"]["by_kind"]
    assert struck == {"kill_prefill": 1, "kill_decode": 1, "kill_scheduler": 1, "kill_gateway": 1,
                      "redis_restart": 1, "conn_drop": SHORT["conn_drops"], "kv_corrupt": SHORT["corrupt_handoffs"]}
    assert all(s["in_flight"] > 0 for s in result["faults"]["struck"])  # every fault hit requests in flight
    (kill,) = [s for s in result["faults"]["struck"] if s["kind"] == "kill_scheduler"]
    assert kill["detail"].startswith(f"the leader (chaos-{kill['target']}); chaos-scheduler-")  # the standby took over
    assert run.returncode == (0 if result["ok"] else 1)
    assert result["ok"], run.stdout + run.stderr[-3000:]
