"""Liveness of pdq's long-lived loops, and how a process goes down when one cannot go on.

Each loop (model loops, cancel listener, output follower, dispatcher, janitor, heartbeats) owns
a `Liveness`: `beat()` after each round it completes, `error(exc)` for a failure it rides
through (logged once per streak, counted), `stopped()` when it ends. They are the metrics
`pdq_loop_alive`, `pdq_loop_last_progress_timestamp_seconds` and `pdq_loop_errors`.

A loop that cannot go on (its dependency stayed down past its window, or it broke in a way it
cannot repair) calls `fatal(reason)`: the process's `on_fatal` handler (set by
`pdq.transport.serving.run_until_signal`) turns health NOT_SERVING and stops the process with exit code 1,
so its supervisor (Kubernetes, `pdq up`) restarts it. Never a silent thread death.
"""

import logging
import threading
import time
from collections.abc import Callable

from pdq.observability import metrics

log = logging.getLogger("pdq.liveness")

_on_fatal: list[Callable[[str], None]] = []
_lock = threading.Lock()


class Liveness:
    def __init__(self, loop: str):
        self.loop = loop
        self.failing = 0  # errors in a row
        metrics.LOOP_ALIVE.labels(loop).set(1)
        metrics.LOOP_PROGRESS.labels(loop).set(time.time())

    def beat(self) -> None:
        """A round completed."""
        if self.failing:
            log.warning("%s: recovered after %d failed round(s)", self.loop, self.failing)
            self.failing = 0
        metrics.LOOP_PROGRESS.labels(self.loop).set(time.time())

    def error(self, exc: BaseException) -> int:
        """A round failed and the loop carries on (it backs off). Logged at the first failure of a
        streak (then every 50th). -> failures in a row."""
        self.failing += 1
        metrics.LOOP_ERRORS.labels(self.loop).inc()
        if self.failing == 1 or self.failing % 50 == 0:
            log.warning("%s: %s (failure %d in a row; backing off and retrying)", self.loop, exc, self.failing)
        return self.failing

    def stopped(self) -> None:
        metrics.LOOP_ALIVE.labels(self.loop).set(0)


def on_fatal(handler: Callable[[str], None]) -> None:
    """Sets what `fatal` does in this process (the server's stop-and-exit); called once at start."""
    with _lock:
        _on_fatal[:] = [handler]


def fatal(loop: str, reason: str) -> None:
    """Loop `loop` cannot go on: log it, mark it dead, and take the process down (NOT_SERVING, exit
    1) through the handler `on_fatal` set. Thread-safe; without a handler (a library user, a
    test), only logs and marks."""
    log.critical("%s cannot go on: %s; taking the process down", loop, reason)
    metrics.LOOP_ALIVE.labels(loop).set(0)
    with _lock:
        handlers = list(_on_fatal)
    for handler in handlers:
        handler(f"{loop}: {reason}")
