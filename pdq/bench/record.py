"""What one run produced, request by request: the raw timestamps every metric is computed from.

All times are seconds on one monotonic clock (`time.perf_counter`), relative to the run's
start. A run is one workload through one system (a strategy of the service, or a baseline) at
one offered load.
"""

from dataclasses import dataclass, field

from pdq.bench.arrivals import Arrivals
from pdq.bench.workload import BenchRequest, Workload


@dataclass
class RequestRecord:
    """due: when the request was offered (latency counts from here); token_times: when each
    output token reached the client, in order; end: when the request's last message arrived
    (or its error); error: "" or "CODE: details"."""

    request: BenchRequest
    due: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.end is not None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.due if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.end - self.due if self.end is not None else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


@dataclass
class RunRecord:
    """name: "continuous", "hf", "engine", ...; strategy: the batching strategy that ran
    (for a baseline: its own name); client_cpu_s: CPU seconds the benchmark process spent
    while the run lasted (for a baseline, that is the baseline's own work); server_cpu_s: CPU
    seconds of each process of a spawned cluster during the run ({} for a baseline, which has
    none; None: not known, e.g. a --target cluster)."""

    name: str
    strategy: str
    workload: Workload
    arrivals: Arrivals
    requests: list[RequestRecord]
    client_cpu_s: float | None = None
    server_cpu_s: dict[str, float] | None = None
    notes: dict = field(default_factory=dict)

    @property
    def start(self) -> float:
        return min((r.due for r in self.requests), default=0.0)

    @property
    def duration(self) -> float:
        """From the first request's due time to the last request's end."""
        ends = [r.end for r in self.requests if r.end is not None]
        return max(ends) - self.start if ends else 0.0
