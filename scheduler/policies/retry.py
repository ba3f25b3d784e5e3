"""Retries that help: which failures are a request's own, and when a worker whose KV hand-offs
keep failing is quarantined.

A failed attempt is the request's own failure (an error running it on a worker, a failed KV
hand-off): it counts towards max_attempts, and the request avoids that attempt's workers next
time (`batch.acceptable`) after a backoff. An attempt lost to infrastructure (a worker that
died, was reaped or is shutting down, a lease that expired, a Prefill call that did not reach
its worker) counts only towards max_lost_attempts.

Blame for a failed hand-off, which involves two workers: each worker's failed hand-offs in a row
are counted with the workers on the other side, and a success ends its streak (HANDOFFS in
`pdq.state.keys`). A worker is quarantined when its streak reaches `after` with at least two different
workers on the other side: a bad worker fails with everyone, while a good worker that failed
with one bad partner succeeds with the others, which ends its streak. Failures all with one
partner cannot tell the two apart, so they quarantine nobody (the avoid lists still send the
retries elsewhere). The last usable worker of a role is never quarantined (that would stop the
service), and a quarantined worker is still used when no other of its role is usable.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pdq.state.ending import FAILURE, LOST

T = TypeVar("T")

# PrefillItemResult.failure (pdq.v1.AttemptFailure) values
UNSPECIFIED, REQUEST, HANDOFF, LOST_ATTEMPT = 0, 1, 2, 3


def classify(failure: int, error: str) -> tuple[str, bool]:
    """A failed prefill item as (kind, whether its KV hand-off failed), from the worker's
    `failure` (AttemptFailure) or, when it did not say, from its error text."""
    if failure == LOST_ATTEMPT or (failure == UNSPECIFIED and "shutting down" in error):
        return LOST, False
    if failure == HANDOFF or (failure == UNSPECIFIED and "KV hand-off" in error):
        return FAILURE, True
    return FAILURE, False


@dataclass(frozen=True)
class Quarantine:
    """`after` failed hand-offs in a row (with two or more different workers on the other side)
    quarantine a worker for base_ms, doubled per earlier quarantine, at most max_ms."""

    after: int = 3
    base_ms: int = 30_000
    max_ms: int = 600_000

    def duration_ms(self, streak: int, peers: int, times: int, others_usable: int) -> int | None:
        """How long to quarantine a worker with `streak` failed hand-offs in a row with `peers`
        distinct workers, quarantined `times` times before, while `others_usable` other workers
        of its role can take work. None: not now."""
        if streak < self.after or peers < 2 or others_usable < 1:
            return None
        return min(self.max_ms, self.base_ms * 2 ** min(times, 30))


def prefer_healthy(workers: list[T], quarantined: Callable[[T], bool]) -> list[T]:
    """The workers that are not quarantined, or all of them when every one is."""
    healthy = [w for w in workers if not quarantined(w)]
    return healthy or workers
