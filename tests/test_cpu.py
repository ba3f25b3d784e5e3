"""pdq.ops.cpu: a thread under "batch" (SCHED_BATCH) passes it to the threads it starts, gets its
policy back when the block ends, and a child spawned under it runs under it."""

import os
import subprocess
import sys
import threading
import time

import pytest

from pdq.ops import cpu
from pdq.ops.child import spawn, stop


def policy_of(tid: int) -> int:
    return os.sched_getscheduler(tid)


def test_a_block_puts_the_thread_and_its_new_threads_under_batch_then_restores():
    assert cpu.current() == "normal"
    seen = {}
    with cpu.policy("batch"):
        assert cpu.current() == "batch"
        t = threading.Thread(target=lambda: seen.setdefault("policy", policy_of(0)))
        t.start()
        t.join()
    assert seen["policy"] == os.SCHED_BATCH
    assert cpu.current() == "normal" and policy_of(0) == os.SCHED_OTHER
    with cpu.policy("normal"):  # "normal" inside "normal" changes nothing
        assert policy_of(0) == os.SCHED_OTHER


def test_a_refused_change_leaves_the_thread_as_it_was():
    assert cpu.apply("batch") and cpu.current() == "batch"
    assert cpu.apply("normal") and cpu.current() == "normal"
    assert cpu.apply("batch", pid=2**22 + 12345) is False  # no such thread: refused, nothing raised
    assert cpu.current() == "normal"


def test_an_unknown_policy_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="batch"):
        cpu.apply("idle")
    with pytest.raises(ValueError, match="CPU policy"):
        spawn([sys.executable, "-c", "pass"], cpu_policy="realtime")


def test_a_spawned_child_runs_under_its_policy_with_every_thread_it_starts():
    code = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print(flush=True)\ntime.sleep(60)")
    proc = spawn([sys.executable, "-c", code], cpu_policy="batch", stdout=subprocess.PIPE)
    try:
        proc.stdout.readline()  # its thread has started
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) == 2
        assert [policy_of(t) for t in tids] == [os.SCHED_BATCH] * 2
    finally:
        stop(proc, grace_s=1)


# -- pinning a model's threads (real torch threads, in a thread of their own) ------------------

def in_model_thread(fn):
    from pdq.engine.worker import ModelThread

    return ModelThread("pin-test").submit(fn).result(timeout=60)


def test_the_model_thread_and_torchs_threads_are_pinned_one_per_cpu_then_unpinned():
    import torch

    cpus = sorted(os.sched_getaffinity(0))

    def pin_and_look():
        torch.set_num_threads(len(cpus))
        pinned = cpu.pin_torch_threads()
        seen = {tid: sorted(os.sched_getaffinity(tid)) for tid, _ in pinned.threads}
        cpu.unpin(pinned)
        after = {tid: sorted(os.sched_getaffinity(tid)) for tid, _ in pinned.threads}
        return threading.get_native_id(), pinned, seen, after

    me, pinned, seen, after = in_model_thread(pin_and_look)
    if len(cpus) < 2:  # one CPU: nothing to spread over
        assert pinned.threads == ()
        return
    assert [tid for tid, _ in pinned.threads][0] == me  # the caller first, then torch's threads
    assert len(pinned.threads) == len(cpus)
    assert seen == {tid: [c] for tid, c in pinned.threads}
    assert sorted(c for _, c in pinned.threads) == cpus
    assert after == {tid: cpus for tid, _ in pinned.threads}


def test_threads_that_are_not_as_many_as_the_cpus_are_left_alone():
    cpus = len(os.sched_getaffinity(0))
    calls = []
    assert cpu.pin_model_threads(cpus + 1, lambda: calls.append(1)) == cpu.Pinned()
    assert calls == []  # not even looked for
    before = os.sched_getaffinity(0)
    # as many as the CPUs, but no thread ran beside the caller: nothing to pin
    def alone():  # 50 ms of work in this thread only
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    assert cpu.pin_model_threads(max(2, cpus), alone) == cpu.Pinned()
    assert os.sched_getaffinity(0) == before


def test_pdq_up_says_when_the_workers_run_bfloat16_on_a_cpu_with_bfloat16_units(tmp_path):
    from pdq.ops.cpu import cpu_flags, dtype_note

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f amx_tile amx_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    flags = cpu_flags(str(info))
    assert {"avx512f", "amx_bf16"} <= flags  # the first CPU's line
    assert "bfloat16" in dtype_note(None, flags, gpu=False) and "--dtype float32" in dtype_note(None, flags, gpu=False)
    assert dtype_note("float32", flags, gpu=False) == ""  # chosen explicitly: nothing to say
    assert dtype_note(None, flags, gpu=True) == ""
    assert "AVX512_BF16" in dtype_note(None, frozenset({"avx512f", "avx512_bf16"}), gpu=False)  # AMD Zen 4
    assert dtype_note(None, frozenset({"avx512f"}), gpu=False) == ""  # no bfloat16 unit: float32, as ever
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
    from pdq.cli import build_parser

    assert build_parser().parse_args(["up", "--dtype", "float32"]).dtype == "float32"
    assert build_parser().parse_args(["up"]).dtype is None  # the machine's default (the note above)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--dtype", "int8"])
