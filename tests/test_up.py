"""`pdq up` splits the machine's cores between its local workers."""

import os

from pdq.up import cpu_share_env


def test_workers_split_the_cores_and_idle_threads_sleep():
    cores = len(os.sched_getaffinity(0))
    env = cpu_share_env(2, {})
    assert env["PDQ_THREADS"] == str(max(1, cores // 2))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PDQ_BURST_THREADS"] == str(cores)
    assert cpu_share_env(10 * cores, {})["PDQ_THREADS"] == "1"  # never 0 (torch's default)


def test_what_the_user_set_wins():
    assert cpu_share_env(2, {"PDQ_THREADS": "4", "OMP_WAIT_POLICY": "ACTIVE"}) == {}
