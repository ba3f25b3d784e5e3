"""`pdq up` splits the machine's cores between its local workers."""

import os

from pdq.ops.up import OMP_SPIN_COUNT, YIELD_TO_PREFILL_MS, Cluster, cpu_share_env


def test_workers_split_the_cores_and_decode_yields_to_prefill():
    cores = len(os.sched_getaffinity(0))
    env = cpu_share_env(2, {})
    assert env["PDQ_THREADS"] == str(max(1, cores // 2))
    assert env["PDQ_BURST_THREADS"] == str(cores)
    assert env["PDQ_YIELD_TO_PREFILL_MS"] == YIELD_TO_PREFILL_MS
    assert env["GOMP_SPINCOUNT"] == OMP_SPIN_COUNT and "OMP_WAIT_POLICY" not in env  # spin briefly, then sleep
    assert cpu_share_env(10 * cores, {})["PDQ_THREADS"] == "1"  # never 0 (torch's default)
    assert "PDQ_YIELD_TO_PREFILL_MS" not in cpu_share_env(1, {})  # a worker alone has nothing to yield to
    assert cpu_share_env(1, {})["PDQ_PIN_THREADS"] == "true"  # ... and owns the cores: its threads are pinned
    assert "PDQ_PIN_THREADS" not in cpu_share_env(2, {})  # workers that share the cores are not


def test_what_the_user_set_wins():
    assert cpu_share_env(2, {"PDQ_THREADS": "4", "PDQ_YIELD_TO_PREFILL_MS": "0", "OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert cpu_share_env(1, {"PDQ_THREADS": "2", "PDQ_PIN_THREADS": "false", "GOMP_SPINCOUNT": "0"}) == {}
    assert "GOMP_SPINCOUNT" not in cpu_share_env(2, {"GOMP_SPINCOUNT": "0"})


def test_decode_workers_run_nicer_unless_colocated_or_told(monkeypatch):
    monkeypatch.delenv("PDQ_UP_DECODE_NICE", raising=False)
    assert Cluster().worker_nice == 5  # prefill, the scheduler and the gateway go first
    assert Cluster(colocate=True).worker_nice == 0  # it prefills too: nothing to give way to
    monkeypatch.setenv("PDQ_UP_DECODE_NICE", "2")
    assert Cluster().worker_nice == Cluster(colocate=True).worker_nice == 2


def test_the_control_plane_yields_the_cores_unless_told(monkeypatch):
    assert Cluster().control_policy == "batch"  # Redis, the scheduler and the gateway (pdq.ops.cpu)
    monkeypatch.setenv("PDQ_UP_CONTROL_POLICY", "normal")
    assert Cluster().control_policy == "normal"
