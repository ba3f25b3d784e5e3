"""The order of choice over the whole queue: tier, then tenant, then the tenant's own order."""

from collections.abc import Iterator
from dataclasses import dataclass, replace

from scheduler.policies.batch import Candidate
from scheduler.policies.fair import FIFO, VTC, TenantQueue
from scheduler.policies.tiers import AgingTiers, StrictTiers


@dataclass
class TierQueue:
    """One tier's backlog: rank 0 is the best tier."""

    tier: str
    rank: int
    tenants: list[TenantQueue]


def schedule(tiers: list[TierQueue], now_ms: int, tiers_policy: AgingTiers | StrictTiers,
             fair: VTC | FIFO) -> Iterator[Candidate]:
    """Yields queued requests in the order of choice: the tier the tier policy ranks first, in
    it the tenant the fair-share policy picks, and that tenant's next request. Each choice is
    charged to the tenant's counter before the next, as if requests were dispatched one by one.
    Works on copies: the inputs are left as they were. Stops when every queue is empty.
    """
    live = [TierQueue(t.tier, t.rank, [replace(q, heads=list(q.heads), taken=q.taken) for q in t.tenants])
            for t in tiers]
    while True:
        best = None
        for tier in live:
            waiting = [q for q in tier.tenants if q.waiting]
            if not waiting:
                continue
            key = tiers_policy.key(tier.rank, min(q.oldest_ms for q in waiting), now_ms)
            if best is None or key < best[0]:
                best = (key, waiting)
        if best is None:
            return
        queue = fair.pick(best[1])
        cand = queue.take()
        fair.charge(queue, cand)
        yield cand
