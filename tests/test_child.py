"""Children started with pdq.ops.child.spawn die with their parent and run as nice as asked."""

import os
import signal
import subprocess
import sys
import time

from pdq.ops.child import stop

PARENT = """
import sys, time
from pdq.ops.child import spawn
child = spawn([sys.executable, "-c", "import time; time.sleep(120)"], nice=3)
print(child.pid, flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not reaped yet
    except FileNotFoundError:
        return True


def test_a_child_dies_with_its_parent_and_keeps_its_pid_and_niceness():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 30

        def execd() -> bool:  # the command's own cmdline (right after Popen, mid-exec, it can read empty)
            cmdline = open(f"/proc/{pid}/cmdline").read()
            return "time.sleep(120)" in cmdline and "pdq.ops.child" not in cmdline

        while not execd():
            assert time.monotonic() < deadline, "the child never exec'd its command"
            time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 3
        assert not gone(pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        while not gone(pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.01)
    finally:
        parent.kill()
        parent.wait()


def test_stop_kills_what_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE)
    proc.stdout.readline()  # SIGTERM is ignored from here on
    assert stop(proc, grace_s=0.5) == -signal.SIGKILL
