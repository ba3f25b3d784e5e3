"""pdq.engine.worker.ModelThread: a worker loads its model and runs its model loop in one thread (one
OpenMP thread pool: see its docstring). Calls run one at a time, in order, on that one thread."""

import asyncio
import queue
import threading

import pytest

from decode_worker.loop import DecodeLoop
from pdq.observability import liveness
from pdq.engine.worker import ModelLoop, ModelThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    thread = ModelThread("t")
    order = []
    futures = [thread.submit(lambda i=i: order.append((i, threading.get_ident()))) for i in range(5)]
    for f in futures:
        f.result(timeout=10)
    assert [i for i, _ in order] == list(range(5))
    assert len({ident for _, ident in order}) == 1 and order[0][1] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(timeout=10)
    assert thread.submit(threading.get_ident).result(timeout=10) == order[0][1]  # still serving


def test_an_event_loop_awaits_a_call():
    thread = ModelThread("t")

    async def main():
        return await thread.run(lambda a, b: (a + b, threading.current_thread().name), 2, 3)

    assert asyncio.run(main()) == (5, "t")


class Recorded(DecodeLoop):
    ran_on: int | None = None

    def _shutdown(self) -> None:
        self.ran_on = threading.get_ident()
        super()._shutdown()


def test_a_model_loop_runs_on_the_thread_that_loaded_the_model():
    thread = ModelThread("model")
    loaded_on = thread.submit(threading.get_ident).result(timeout=10)  # as `load_runner` would
    loop = Recorded(None, None, None, None, [], "here", lambda rid: None)
    loop.start(thread)
    loop.stop()  # returns once the loop has ended
    assert loop.ran_on == loaded_on


class Broken(ModelLoop):
    thread_name = "broken-loop"

    def __init__(self):
        self.inbox = queue.Queue()

    def _run(self) -> None:
        raise RuntimeError("a bug")


def test_a_model_loop_that_dies_takes_the_process_down_instead_of_vanishing():
    reasons: list[str] = []
    liveness.on_fatal(reasons.append)
    try:
        loop = Broken()
        loop.start(ModelThread("model"))
        loop._done.result(timeout=10)  # its thread ended; the error did not stay in the future
        assert reasons == ["broken-loop: RuntimeError: a bug"] and not loop.alive
        loop.stop()  # returns: nothing left to stop
    finally:
        liveness.on_fatal(lambda reason: None)


def test_a_worker_that_owns_the_cpus_loads_its_model_with_its_threads_pinned_one_per_cpu():
    """load_runner with as many torch threads as CPUs (a colocated worker) pins the model thread
    and torch's threads (pdq.ops.cpu); with pin_threads off, nothing is pinned."""
    import os

    from pdq.config import WorkerConfig
    from pdq.ops.cpu import Pinned, thread_runtimes, unpin
    from pdq.engine.worker import load_runner

    cpus = sorted(os.sched_getaffinity(0))

    def load(pin: bool):
        load_runner(WorkerConfig(model="builtin:tiny", threads=len(cpus), pin_threads=pin), 4096, (64, 32))
        me = threading.get_native_id()
        mine = os.sched_getaffinity(me)
        narrowed = sorted(t for t in thread_runtimes() if t != me and len(os.sched_getaffinity(t)) < len(cpus))
        unpin(Pinned(tuple((t, 0) for t in [me, *narrowed]), frozenset(cpus)))
        return sorted(mine), narrowed

    assert ModelThread("unpinned").submit(load, False).result(timeout=120) == (cpus, [])
    mine, narrowed = ModelThread("pinned").submit(load, True).result(timeout=120)
    if len(cpus) < 2:
        assert (mine, narrowed) == (cpus, [])
    else:
        assert len(mine) == 1 and len(narrowed) == len(cpus) - 1  # each torch thread on a CPU of its own
