"""Restarting the processes of a local cluster when they exit (`pdq up`'s supervision).

A `Supervisor` watches `Child` processes and, when one exits, starts it again the same way (same
arguments, so the same port and worker id) after a bounded exponential backoff: `first_s`, then
twice as long after each exit that came less than `healthy_s` after its start, at most `max_s`.
It never sleeps: `poll()` notices exits and starts what is due, and is meant to be called often
(every ~0.1-0.2 s) from the thread that started the children, since a child started by
`pdq.ops.child.spawn` dies with the thread that spawned it.
"""

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a process that exited (seconds)."""

    first_s: float = 0.5  # the wait before the first restart of a streak
    max_s: float = 30.0  # the longest wait
    healthy_s: float = 30.0  # a process that ran this long before exiting starts a new streak

    def __post_init__(self) -> None:
        if not 0 <= self.first_s <= self.max_s:
            raise ValueError(f"need 0 <= first_s <= max_s, got {self.first_s} and {self.max_s}")
        if self.healthy_s < 0:
            raise ValueError(f"healthy_s must be >= 0, got {self.healthy_s}")

    def delay_s(self, streak: int) -> float:
        """The wait before restarting after the `streak`-th quick exit in a row (1, 2, ...)."""
        return min(self.max_s, self.first_s * 2 ** min(max(0, streak - 1), 32))


@dataclass
class Child:
    """One process of the cluster. `launch` starts it again as it was first started (same
    arguments, port and worker id) and returns its new Popen; None: it is not restarted."""

    name: str
    port: int
    process: subprocess.Popen
    metrics_port: int = -1  # its Prometheus /metrics port (-1 = none)
    launch: Callable[[], subprocess.Popen] | None = field(default=None, repr=False)
    restarts: int = 0  # how many times it was started again
    started: float = field(default_factory=time.monotonic, repr=False)  # its current life's start
    streak: int = field(default=0, repr=False)  # its exits in a row, each less than healthy_s after a start
    restart_at: float | None = field(default=None, repr=False)  # while it is down: when it starts again
    killed_down_s: float | None = field(default=None, repr=False)  # set by `kill`: how long to stay down
    note: str = field(default="", repr=False)  # added to the line that reports its exit

    def metrics_url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.metrics_port}/metrics"

    @property
    def down(self) -> bool:
        """Exited (or killed) and not started again yet."""
        return self.restart_at is not None or self.process.poll() is not None


class Supervisor:
    """Restarts the children it is given when they exit, and says so through `log`."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(), log: Callable[[str], None] = print):
        self.policy = policy
        self.log = log
        self.children: list[Child] = []
        self.stopping = False  # set once the cluster stops: nothing is restarted from then on

    def watch(self, child: Child) -> None:
        self.children.append(child)

    def poll(self, now: float | None = None) -> list[Child]:
        """One round: notes the children that exited (scheduling their restart) and starts those
        whose wait is over. Never blocks. -> the children started again in this round."""
        if self.stopping:
            return []
        now = time.monotonic() if now is None else now
        started = []
        for child in list(self.children):
            if child.launch is None:
                continue
            if child.restart_at is None:
                code = child.process.poll()
                if code is not None:
                    self._exited(child, code, now)
            if child.restart_at is not None and now >= child.restart_at:
                self._start(child, now)
                if child.restart_at is None:
                    started.append(child)
        return started

    def _exited(self, child: Child, code: int, now: float) -> None:
        if child.killed_down_s is not None:  # killed on purpose: not the child's fault, no backoff
            delay, child.killed_down_s = child.killed_down_s, None
        else:
            child.streak = 1 if now - child.started >= self.policy.healthy_s else child.streak + 1
            delay = self.policy.delay_s(child.streak)
        child.restart_at = now + delay
        self.log(f"pdq up: {child.name} exited with code {code}; restarting in {delay:.1f} s "
                 f"(restart {child.restarts + 1})" + (f"; {child.note}" if child.note else ""))

    def _start(self, child: Child, now: float) -> None:
        try:
            child.process = child.launch()
        except Exception as exc:  # e.g. out of processes: try again later, with a longer wait
            child.streak += 1
            delay = self.policy.delay_s(child.streak)
            child.restart_at = now + delay
            self.log(f"pdq up: could not restart {child.name} ({exc}); trying again in {delay:.1f} s")
            return
        child.restarts += 1
        child.started, child.restart_at = now, None
        self.log(f"pdq up: {child.name} restarted (pid {child.process.pid})")

    def kill(self, child: Child, sig: int = signal.SIGKILL, down_s: float = 0.0) -> None:
        """Sends `sig` to the child (SIGKILL: and waits until it is gone); its exit is taken as
        deliberate: it is started again `down_s` after the exit is noticed, with no backoff."""
        if child.process.poll() is not None:
            return
        child.killed_down_s = max(0.0, down_s)
        child.process.send_signal(sig)
        if sig == signal.SIGKILL:
            child.process.wait()
