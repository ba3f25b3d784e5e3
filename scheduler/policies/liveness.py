"""Which workers are dead, judged by what the janitor itself saw.

Workers write their heartbeat time into Redis. After a Redis outage every heartbeat looks old
until the workers beat again, and a scheduler that just started has seen nothing, so the age of a
heartbeat says little. Instead a worker is dead when the janitor has seen no new heartbeat of it
for `timeout_s` of its own unbroken observation: successful reads, each ending within
`max_interval_s` of the one before (the time a read took included, so a command retried through
an outage breaks it), with no Redis failure in this process between them. A break starts the
observation over: every worker gets a full `timeout_s` again. With reads every timeout_s / 4 and
max_interval_s = timeout_s / 2, a worker that heartbeats at least every timeout_s / 2 (as
`pdq.config.WorkerConfig` requires) is not taken for dead while Redis is up for it.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class HeartbeatWatch:
    timeout_s: float
    max_interval_s: float
    since: float | None = None  # start of the current unbroken observation (monotonic s)
    _last: float | None = None  # end of the last read
    _seen: dict[str, tuple[float, float]] = field(default_factory=dict)  # worker -> (heartbeat, when it changed)

    def observe(self, ended: float, beats: Mapping[str, float], failed_at: float = 0.0) -> list[str]:
        """Takes a read of every registered worker's heartbeat (`beats`: worker -> heartbeat, as
        written) that ended at `ended` (monotonic s); `failed_at`: when a Redis command of this
        process last failed (monotonic s). -> the workers dead now, sorted."""
        if self._last is None or ended - self._last > self.max_interval_s or failed_at > self._last:
            self.since = ended
            self._seen = {w: (hb, ended) for w, (hb, _) in self._seen.items()}
        self._last = ended
        seen = {}
        for w, hb in beats.items():
            old = self._seen.get(w)
            seen[w] = old if old is not None and old[0] == hb else (hb, ended)
        self._seen = seen
        return sorted(w for w, (_, at) in seen.items() if ended - at >= self.timeout_s)

    def settled(self, now: float) -> bool:
        """Has the observation run unbroken for timeout_s? (Until then, leases that expired may be
        an outage's doing: their workers may not have been able to move them on.)"""
        return self.since is not None and now - self.since >= self.timeout_s

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)
