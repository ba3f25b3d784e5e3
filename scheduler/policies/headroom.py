"""Decode slot headroom: the last free slots go to tenants below their fair share.

Continuous batching keeps the decode pool full, so a flooding tenant would hold every slot and
a newcomer would wait until one of the flood's sequences ends. Token-fair queue order does not
help then: the newcomer is first in line, but there is no seat. So while other tenants are
active (running, queued, or served recently), a tenant holding at least its weighted share of
the pool's slots cannot take the last `reserve` free ones: they stay open for tenants below
their share, who get a seat at once. A tenant alone uses the whole pool.

The same test sets a request's prefill urgency (`prefill_priority`): tier first, then tenants
below their share before those at or above it; a prefill worker's pass takes only the most
urgent prompts it holds.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Headroom:
    reserve: int = 1  # free slots kept for tenants below their share (0 = off)

    def allows(self, tenant: str, free: int, capacity: int, running: dict[str, int],
               weights: dict[str, float], active: set[str]) -> bool:
        """May a request of `tenant` take one of the `free` decode slots (of `capacity`)?
        `running`: slots each tenant holds; `weights`: fair-share weights (missing = 1);
        `active`: tenants that compete for the pool now (the asking tenant counts too)."""
        if free <= 0:
            return False
        if free > self.reserve:
            return True
        return below_share(tenant, capacity, running, weights, active)

    def keep_free(self, under_share: bool, free: int, worker_free: int) -> int:
        """The slots a decode worker must still have free to grant a reservation
        (`ReserveRequest.keep_free`): 0 for a tenant below its share; else what the reserve needs
        beyond the `free - worker_free` slots free on the other workers. The free counts come
        from heartbeats, which can lag a worker's last grants; the worker checks against its own
        count, so a stale heartbeat cannot hand the reserved slot to a tenant at its share."""
        return 0 if under_share else max(0, self.reserve - (free - worker_free))


def below_share(tenant: str, capacity: int, running: dict[str, int], weights: dict[str, float],
                active: set[str]) -> bool:
    """Does `tenant` hold fewer of the pool's `capacity` slots than its weighted share among the
    `active` tenants (itself included)? A tenant alone is always below its share."""
    if not (active - {tenant}):
        return True
    competing = active | {tenant}
    total = sum(weights.get(t, 1.0) for t in competing)
    return running.get(tenant, 0) < capacity * weights.get(tenant, 1.0) / total


def prefill_priority(tier_rank: int, under_share: bool) -> int:
    """A request's prefill urgency, lower first (`PrefillItem.priority`): by tier, then tenants
    below their fair share of decode slots before those at or above it."""
    return 2 * tier_rank + (0 if under_share else 1)


@dataclass(frozen=True)
class Placement:
    """One request of a dispatch round, placed: its decode worker, whether its tenant is below
    its fair share, and the `keep_free` its reservation carries."""

    candidate: Any
    worker: Any
    under_share: bool
    keep_free: int


def place_round(batch: list, slots: list, prefill_address: str, headroom: Headroom, capacity: int,
                running: dict[str, int], weights: dict[str, float], active: set[str], choose) -> list[Placement]:
    """Which requests of a dispatch round get a decode seat, and where (pure: plain data in,
    placements out). In batch order, while any slot is free: a request its headroom refuses waits
    (the last free slots are for tenants below their share); else `choose(slots,
    prefill_address, candidate)` (`batch.decode_chooser`) picks its worker (None: the workers it accepts are full, it
    waits). Each placement counts as granted for the requests after it: its worker's
    `free_slots` goes down by one and its tenant's `running` up by one (both updated in place;
    the reservation replies correct them)."""
    out = []
    for cand in batch:
        free = sum(s.free_slots for s in slots)
        if free <= 0:
            break
        if not headroom.allows(cand.tenant, free, capacity, running, weights, active):
            continue
        choice = choose(slots, prefill_address, cand)
        if choice is None:
            continue
        under = below_share(cand.tenant, capacity, running, weights, active)
        out.append(Placement(cand, choice, under, headroom.keep_free(under, free, choice.free_slots)))
        choice.free_slots -= 1
        running[cand.tenant] = running.get(cand.tenant, 0) + 1
    return out
