"""Between the tenants of one tier: whose request goes next.

`vtc` is the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI '24): each tenant has a counter of the tokens it was served (prompt + output) divided by
its weight; the backlogged tenant with the lowest counter goes next. Counters live in Redis
(charged by the CLAIM script, corrected when a request ends, lifted when a tenant returns from
idle, see pdq.state.keys); a policy here only reads them and, while a batch is formed, charges the
copies it works on so that one batch is as fair as a sequence of single dispatches.
"""

from dataclasses import dataclass, field

from scheduler.policies.batch import Candidate


@dataclass
class TenantQueue:
    """One backlogged tenant of a tier: its counter, weight and queue head (in its own order)."""

    tenant: str
    counter: float
    weight: float
    heads: list[Candidate]
    taken: int = 0  # heads already chosen
    _oldest: int | None = field(default=None, repr=False)

    @property
    def waiting(self) -> bool:
        return self.taken < len(self.heads)

    @property
    def head(self) -> Candidate:
        return self.heads[self.taken]

    def take(self) -> Candidate:
        cand = self.heads[self.taken]
        self.taken += 1
        self._oldest = None
        return cand

    @property
    def oldest_ms(self) -> int:
        """Arrival time of its oldest remaining request (its head, unless ordered otherwise)."""
        if self._oldest is None:
            self._oldest = min(c.created_ms for c in self.heads[self.taken:])
        return self._oldest


@dataclass(frozen=True)
class VTC:
    """Lowest counter first. Ties (a tenant back from idle is lifted to exactly the lowest
    counter) go to the tenant with fewer requests waiting, so a trickle is not kept behind a
    flood it has caught up with; then to the oldest head, then by name."""

    def pick(self, queues: list[TenantQueue]) -> TenantQueue:
        return min(queues, key=lambda q: (q.counter, len(q.heads) - q.taken, q.head.created_ms, q.tenant))

    def charge(self, queue: TenantQueue, cand: Candidate) -> None:
        queue.counter += cand.kv_tokens / queue.weight


@dataclass(frozen=True)
class FIFO:
    """No fairness: the tenant whose head arrived first (a baseline to compare VTC with)."""

    def pick(self, queues: list[TenantQueue]) -> TenantQueue:
        return min(queues, key=lambda q: (q.head.created_ms, q.tenant))

    def charge(self, queue: TenantQueue, cand: Candidate) -> None:
        pass


FAIR_POLICIES = {"vtc": VTC, "fifo": FIFO}


def fair_policy(name: str) -> VTC | FIFO:
    try:
        return FAIR_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown fair-share policy {name!r}") from None
