"""CPU scheduling policy: which processes yield the cores to the model on a small machine, and
where a model's threads run (`pin_model_threads`: one per CPU when the model owns them all).

A forward pass runs on every core, one OpenMP thread each, and each parallel region ends at a
barrier. When a gateway, scheduler, Redis or benchmark client thread wakes up (a token to
stream, a request to dispatch), the kernel lets it preempt one of those threads at once; the
other threads then wait at the barrier, so the model loses about twice the CPU the waking
thread uses. Under Linux's SCHED_BATCH a waking thread does not preempt a running one: it runs
when a core frees up (an OpenMP thread waiting at a barrier, the model thread waiting on
Redis) or when the running thread's time slice ends. It keeps its full weight, so it is never
starved, only later to run while the model keeps every core busy. `pdq up` starts its gateway, scheduler and Redis under it
("batch"), and `pdq bench` runs its clients under it.

Policies are per thread on Linux and new threads inherit their creator's, so `apply` at a
process's start (before it starts threads) covers the whole process. Elsewhere (no
`os.sched_setscheduler`) every policy is "normal" and nothing changes.
"""

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

POLICIES = ("normal", "batch")


def native(name: str) -> int | None:
    """The os.SCHED_* constant of `name`; None where the platform has no such policy."""
    if name not in POLICIES:
        raise ValueError(f"CPU policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if not hasattr(os, "sched_setscheduler"):
        return None
    return os.SCHED_BATCH if name == "batch" else os.SCHED_OTHER


def apply(name: str, pid: int = 0) -> bool:
    """Puts thread `pid` (0: the calling thread, and the threads it starts later) under policy
    `name`. -> False where the system refuses (a sandbox that filters sched_setscheduler): the
    thread runs on as it was, which is only slower on a small machine, never wrong."""
    constant = native(name)
    if constant is None:
        return False
    try:
        os.sched_setscheduler(pid, constant, os.sched_param(0))
    except OSError:
        return False
    return True


def current() -> str:
    """The calling thread's policy: "batch", else "normal"."""
    if hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) == os.SCHED_BATCH:
        return "batch"
    return "normal"


@contextmanager
def policy(name: str) -> Iterator[None]:
    """The calling thread, and the threads it starts meanwhile, run under `name`; then it is restored."""
    before = current()
    apply(name)
    try:
        yield
    finally:
        apply(before)


# -- pinning a model's threads -----------------------------------------------------------------

def thread_runtimes() -> dict[int, int]:
    """Nanoseconds each thread of this process has run (Linux: /proc/self/task/*/schedstat);
    {} where that is not available."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


@dataclass(frozen=True)
class Pinned:
    """Threads `pin_model_threads` pinned, (thread id, CPU) each, and the CPUs they had before."""

    threads: tuple[tuple[int, int], ...] = ()
    cpus: frozenset[int] = frozenset()


def pin_model_threads(threads: int, parallel: Callable[[], None]) -> Pinned:
    """Pins the calling thread (a model's) and the OpenMP threads that run its parallel regions
    one to a CPU, when they are `threads` in all and the caller may use exactly that many CPUs
    (the model owns the machine); else changes nothing (an empty Pinned).

    Why: a forward pass runs a parallel region per operator on every core, and a control-plane
    process that wakes takes a core meanwhile. Unpinned, the kernel then often wakes the OpenMP
    thread on the model thread's own core, where the two take turns until it moves one of them.
    Pinned, each keeps its core and waits there for it.

    The OpenMP threads are found by what they do: `parallel` (a parallel torch op, run here for
    tens of milliseconds) makes them run at least half as long as the caller; the other threads of
    the process run little then. Linux only; elsewhere, or if the count found is not
    `threads` - 1, nothing is pinned.
    """
    if not hasattr(os, "sched_setaffinity") or threads < 2:
        return Pinned()
    cpus = frozenset(os.sched_getaffinity(0))
    if len(cpus) != threads:
        return Pinned()
    me = threading.get_native_id()
    before = thread_runtimes()
    parallel()
    after = thread_runtimes()
    ran = {tid: after[tid] - before.get(tid, 0) for tid in after}
    mine = ran.get(me, 0)
    helpers = sorted(tid for tid, ns in ran.items() if tid != me and mine and ns >= mine / 2)
    if len(helpers) != threads - 1:
        return Pinned()
    pinned = Pinned(tuple(zip([me, *helpers], sorted(cpus))), cpus)
    try:
        for tid, cpu in pinned.threads:
            os.sched_setaffinity(tid, {cpu})
    except OSError:  # a sandbox that refuses: run unpinned, as before
        unpin(pinned)
        return Pinned()
    return pinned


def unpin(pinned: Pinned) -> None:
    """Lets the threads `pin_model_threads` pinned run on the CPUs they had before."""
    for tid, _ in pinned.threads:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, pinned.cpus)


def pin_torch_threads() -> Pinned:
    """`pin_model_threads` for torch's CPU threads, from the thread that runs the model."""
    import time

    import torch

    def parallel() -> None:  # an elementwise op over 4M floats runs on every torch thread
        x = torch.ones(1 << 22)
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            x.mul_(1.0)

    return pin_model_threads(torch.get_num_threads(), parallel)


def cpuinfo_field(name: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first CPU's `name` line of /proc/cpuinfo (e.g. vendor_id, flags), or "" where it does
    not say."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (/proc/cpuinfo's `flags`); empty where it does not say."""
    return frozenset(cpuinfo_field("flags", cpuinfo).split())


# The vector and matrix units a benchmark's machine record names (`cpu_units`), widest last.
VECTOR_UNITS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX"))


def cpu_units(flags: frozenset[str]) -> list[str]:
    """The VECTOR_UNITS among `flags` (`cpu_flags()`), e.g. ["AVX2", "AVX-512"]: CPUs sold under one
    model name (a VM's "AMD EPYC") differ in them, and the model's speed on them differs."""
    return [name for flag, name in VECTOR_UNITS if flag in flags]


# CPU flags of bfloat16 matrix instructions, and what they are called: oneDNN's bfloat16 GEMM runs
# on them (AMX tiles: Intel Xeon 4th generation and later; AVX512_BF16's dot products: AMD Zen 4
# and later, Intel Cooper Lake), and without them bfloat16 is emulated and no faster than float32.
BFLOAT16_UNITS = (("amx_bf16", "AMX (amx_bf16)"), ("avx512_bf16", "AVX512_BF16 (avx512_bf16)"))


def bfloat16_unit(flags: frozenset[str]) -> str:
    """The bfloat16 matrix unit a CPU with these flags has, by name ("" when none)."""
    return next((name for flag, name in BFLOAT16_UNITS if flag in flags), "")


def serves_bfloat16(flags: frozenset[str]) -> bool:
    """Whether a CPU with these flags serves bfloat16 by default: it has bfloat16 matrix
    instructions (`BFLOAT16_UNITS`), on which a worker runs the built-in model 1.8-2.1x (AMX) and
    ~1.5x (AVX512_BF16) as fast as in float32 (`pdq.engine.runner.serving_dtype`, BENCHMARKS.md)."""
    return bool(bfloat16_unit(flags))


def dtype_note(dtype: str | None, flags: frozenset[str], gpu: bool) -> str:
    """What `pdq up` says about the model's dtype on this machine: on a CPU with bfloat16 matrix
    instructions and no dtype given (no GPU: `gpu` also for a model with no compute), that the
    workers run bfloat16 there (`pdq.engine.runner.serving_dtype`) and how to keep float32;
    otherwise nothing."""
    if dtype or gpu or not serves_bfloat16(flags):
        return ""
    return (f"pdq up: this CPU has {bfloat16_unit(flags)}: the workers run the model in bfloat16, 1.5-2x the "
            "tokens/s of float32 here; --dtype float32 for float32's outputs (docs/engine.md, 'bfloat16 on CPU')")
