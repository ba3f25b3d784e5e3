"""The capacity sweep's rules (`pdq bench --capacity`), pure: when a step's latency broke, which
offered rate comes next, which step was the best sustained, and what was the bottleneck.

A sweep offers open-loop (Poisson) arrivals at a rate for a fixed time per step, starting at
`start_rps` and multiplying by `factor` until a step breaks; then it bisects (geometric mean)
between the best sustained rate and the lowest broken one `refine` times, while they are more
than 10% apart. A step breaks when any request failed, when its p99 submit-to-done latency
exceeds `p99_ms` plus `token_ms` per output token after the first (a request's own stream
takes that long at 1000 / token_ms tokens/s), or when it completed fewer requests per second
than were offered by more than `shortfall` (the system fell behind: a queue grew during the step).
"""

import math
from dataclasses import dataclass, field

BUSY_PCT = 85.0  # a process this busy (% of one core) is saturated: Python roles run one thread of work
MACHINE_BUSY = 0.85  # all processes together this busy (share of every core): the machine is saturated


@dataclass(frozen=True)
class SweepPlan:
    max_tokens: int
    start_rps: float = 50.0
    factor: float = 1.5
    max_steps: int = 14
    refine: int = 2
    step_s: float = 3.0
    p99_ms: float = 500.0
    token_ms: float = 10.0
    shortfall: float = 0.10

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.start_rps > 0 and self.factor > 1 and self.step_s > 0 and self.p99_ms > 0):
            raise ValueError("capacity: start rate, step seconds and p99 bound must be > 0 and the factor > 1")
        if self.max_steps < 1 or self.refine < 0 or not 0 < self.shortfall < 1 or self.token_ms < 0:
            raise ValueError("capacity: max_steps >= 1, refine >= 0, token_ms >= 0 and 0 < shortfall < 1")

    @property
    def bound_ms(self) -> float:
        """The p99 submit->done latency past which a step broke."""
        return self.p99_ms + self.token_ms * (self.max_tokens - 1)

    def requests_at(self, rps: float) -> int:
        """Requests offered by a step at `rps`: `step_s` seconds of arrivals, at least 20."""
        return max(20, round(rps * self.step_s))


@dataclass
class Step:
    """One step's outcome. offered_rps: the rate its arrivals actually had (requests over their
    span); achieved_rps / tokens_per_s: completed requests and streamed tokens per second from
    the first arrival to the last end; cpu_pct: % of one core per process, the client included."""

    target_rps: float
    offered_rps: float
    achieved_rps: float
    tokens_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    requests: int
    errors: int
    cpu_pct: dict[str, float] = field(default_factory=dict)
    broke: str = ""  # why latency broke ("" = sustained)
    extra: dict = field(default_factory=dict)


def why_broken(step: Step, plan: SweepPlan) -> str:
    """"" when `step` sustained its load, else the first rule it broke, in words."""
    if step.errors:
        return f"{step.errors} of {step.requests} requests failed"
    if step.p99_ms is None or step.p99_ms > plan.bound_ms:
        return f"p99 submit->done {step.p99_ms} ms > {plan.bound_ms:g} ms"
    if step.achieved_rps < (1 - plan.shortfall) * step.offered_rps:
        return (f"completed {step.achieved_rps:.0f}/s < {100 * (1 - plan.shortfall):.0f}% of the offered "
                f"{step.offered_rps:.0f}/s")
    return ""


def next_rate(steps: list[Step], plan: SweepPlan) -> float | None:
    """The target rate of the next step after `steps` (judged: `broke` set), or None: done."""
    if not steps:
        return plan.start_rps
    if len(steps) >= plan.max_steps:
        return None
    broken = [s.target_rps for s in steps if s.broke]
    if not broken:
        return steps[-1].target_rps * plan.factor
    good = [s.target_rps for s in steps if not s.broke and s.target_rps < min(broken)]
    refined = len(steps) - 1 - next(i for i, s in enumerate(steps) if s.broke)
    if not good or refined >= plan.refine or min(broken) / max(good) < 1.1:
        return None
    return math.sqrt(max(good) * min(broken))


def best(steps: list[Step]) -> Step | None:
    """The sustained step that completed the most requests per second (None: none sustained)."""
    return max((s for s in steps if not s.broke), key=lambda s: s.achieved_rps, default=None)


def bottleneck(cpu_pct: dict[str, float], cores: int) -> str:
    """Names what limits a step from its processes' CPU (% of one core each): a process busy
    past BUSY_PCT of its core (one thread of work), else the machine when all its cores are
    nearly busy, else nothing CPU-bound (waits: round trips, timers, the arrival process)."""
    if not cpu_pct:
        return "unknown (no CPU figures)"
    total = sum(cpu_pct.values())
    name, top = max(cpu_pct.items(), key=lambda kv: kv[1])
    busiest = ", ".join(f"{n} {p:.0f}%" for n, p in sorted(cpu_pct.items(), key=lambda kv: -kv[1])[:3])
    if top >= BUSY_PCT:
        return f"{name} (a full core: {top:.0f}%); busiest: {busiest}"
    if total >= MACHINE_BUSY * 100 * cores:
        return f"the machine's {cores} cores ({total:.0f}% of {100 * cores}%); busiest: {busiest}"
    return f"no process CPU-bound ({total:.0f}% of {100 * cores}% in all); busiest: {busiest}"
