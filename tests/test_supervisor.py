"""pdq.ops.supervisor restarts real processes that exit, with a bounded backoff, and says so.

The rounds are driven with explicit clock values (`poll(now=...)`), so nothing here waits for
time to pass: what is checked is which round restarts what."""

import functools
import signal
import sys

import pytest

from pdq.ops.child import spawn
from pdq.ops.supervisor import Child, RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture
def watched():
    """A supervisor (logging into a list) watching one sleeping process started at t=0."""
    lines: list[str] = []
    sup = Supervisor(RestartPolicy(first_s=0.5, max_s=4.0, healthy_s=10.0), log=lines.append)
    launch = functools.partial(spawn, SLEEPER)
    child = Child("decode-0", 0, launch(), launch=launch, started=0.0)
    sup.watch(child)
    yield sup, child, lines
    sup.stopping = True
    if child.process.poll() is None:
        child.process.kill()
        child.process.wait()


def crash(child: Child) -> int:
    """SIGKILL from outside (as the OOM killer would); -> the dead pid."""
    pid = child.process.pid
    child.process.send_signal(signal.SIGKILL)
    child.process.wait()
    return pid


def test_the_backoff_doubles_per_quick_exit_up_to_its_bound():
    policy = RestartPolicy(first_s=0.5, max_s=30.0)
    assert [policy.delay_s(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert policy.delay_s(10_000) == 30.0  # no overflow however long the streak
    with pytest.raises(ValueError):
        RestartPolicy(first_s=5.0, max_s=1.0)


def test_a_killed_process_is_started_again_the_same_way_after_the_backoff(watched):
    sup, child, lines = watched
    dead = crash(child)
    assert sup.poll(now=1.0) == [] and child.down
    assert lines == ["pdq up: decode-0 exited with code -9; restarting in 0.5 s (restart 1)"]
    assert sup.poll(now=1.49) == [] and child.down  # still waiting
    assert sup.poll(now=1.5) == [child]
    assert child.process.pid != dead and child.process.poll() is None and not child.down
    assert child.restarts == 1 and lines[-1] == f"pdq up: decode-0 restarted (pid {child.process.pid})"
    assert child.process.args[-len(SLEEPER):] == SLEEPER  # the same command line (same port, same worker id)

    crash(child)  # again 0.5 s after its restart: a crash loop, the wait doubles
    sup.poll(now=2.0)
    assert lines[-1] == "pdq up: decode-0 exited with code -9; restarting in 1.0 s (restart 2)"
    assert sup.poll(now=2.9) == [] and sup.poll(now=3.0) == [child]

    crash(child)  # this time after running longer than healthy_s: a new streak
    sup.poll(now=3.0 + 10.0)
    assert lines[-1] == "pdq up: decode-0 exited with code -9; restarting in 0.5 s (restart 3)"


def test_nothing_is_restarted_once_stopping(watched):
    sup, child, lines = watched
    sup.stopping = True
    crash(child)
    assert sup.poll(now=100.0) == [] and lines == []
    assert child.process.poll() is not None and child.restarts == 0


def test_a_deliberate_kill_restarts_after_the_asked_down_time_without_backoff(watched):
    sup, child, lines = watched
    for restart, t in ((1, 1.0), (2, 2.0), (3, 3.0)):  # quick kills in a row: no growing wait
        sup.kill(child, down_s=0.3)
        assert child.process.poll() == -signal.SIGKILL  # gone when kill returns
        assert sup.poll(now=t) == []
        assert lines[-1] == f"pdq up: decode-0 exited with code -9; restarting in 0.3 s (restart {restart})"
        assert sup.poll(now=t + 0.29) == [] and sup.poll(now=t + 0.3) == [child]
    assert child.restarts == 3 and child.streak == 0


def test_a_failing_start_is_tried_again_later(watched):
    sup, child, lines = watched
    good = child.launch
    attempts = []

    def broken():
        attempts.append(1)
        raise OSError("out of processes")

    child.launch = broken
    crash(child)
    sup.poll(now=1.0)
    assert sup.poll(now=1.5) == [] and attempts == [1] and child.down
    assert lines[-1] == "pdq up: could not restart decode-0 (out of processes); trying again in 1.0 s"
    child.launch = good
    assert sup.poll(now=2.4) == [] and sup.poll(now=2.5) == [child] and child.restarts == 1


def test_the_exit_line_carries_the_childs_note(watched):
    sup, child, lines = watched
    child.note = "its data is lost (not --durable)"
    crash(child)
    sup.poll(now=1.0)
    assert lines == ["pdq up: decode-0 exited with code -9; restarting in 0.5 s (restart 1); "
                     "its data is lost (not --durable)"]
