"""CPU scheduling policy: which processes yield the cores to the model on a small machine.

A forward pass runs on every core, one OpenMP thread each, and each parallel region ends at a
barrier. When a gateway, scheduler, Redis or benchmark client thread wakes up (a token to
stream, a request to dispatch), the kernel lets it preempt one of those threads at once; the
other threads then wait at the barrier, so the model loses about twice the CPU the waking
thread uses. Under Linux's SCHED_BATCH a waking thread does not preempt a running one: it runs
when a core frees up (an OpenMP thread waiting at a barrier, the model thread waiting on
Redis) or when the running thread's time slice ends. It keeps its full weight, so it is never
starved, only later to run while the model keeps every core busy. `pdq up` starts its gateway, scheduler and Redis under it
("batch"), and `pdq bench` runs its clients under it (BENCHMARKS.md has the measurements).

Policies are per thread on Linux and new threads inherit their creator's, so `apply` at a
process's start (before it starts threads) covers the whole process. Elsewhere (no
`os.sched_setscheduler`) every policy is "normal" and nothing changes.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

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
