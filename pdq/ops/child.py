"""Child processes that die with their parent, started without running Python after fork.

`spawn(args)` starts `python -m pdq.ops.child PARENT_PID NICE POLICY -- args...`. That small process
asks the kernel to send it SIGTERM when its parent dies (PR_SET_PDEATHSIG, kept across exec),
checks that the parent is still there, lowers its priority by NICE, takes the CPU policy
POLICY (`pdq.ops.cpu`, inherited by every thread it starts), and execs `args`: the pid
stays, so the caller's Popen is the real child. Nothing is left behind when a test or `pdq up`
dies. A `preexec_fn` would do the same from inside the parent's image between fork and exec;
in a process whose gRPC threads are busy that child can abort in gRPC's fork handlers
("epoll_wait error: Bad file descriptor"), so none is used.
"""

import os
import signal
import subprocess
import sys

from pdq.ops import cpu


def spawn(args: list[str], nice: int = 0, cpu_policy: str = "normal", **popen_kwargs) -> subprocess.Popen:
    """Popen(args) for a child that dies with this process (and runs `nice` nicer, under
    `cpu_policy`: see pdq.ops.cpu)."""
    cpu.native(cpu_policy)  # a bad name fails here, not in the child
    return subprocess.Popen([sys.executable, "-m", "pdq.ops.child", str(os.getpid()), str(nice), cpu_policy, "--", *args],
                            **popen_kwargs)


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within grace_s. -> its exit status."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def die_with_parent() -> None:
    """The calling process gets SIGTERM when its parent dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str]) -> None:
    parent, nice, policy, command = int(argv[0]), int(argv[1]), argv[2], argv[4:]
    die_with_parent()
    if os.getppid() != parent:  # the parent died before we could follow it
        sys.exit(1)
    if nice:
        os.nice(nice)
    cpu.apply(policy)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
