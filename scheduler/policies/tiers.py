"""Between priority tiers: which tier the next request comes from.

A policy ranks a non-empty tier by a sort key (lowest goes first) from the tier's rank (0 = best)
and the arrival time of its oldest waiting request.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class StrictTiers:
    """The best non-empty tier always goes first (a flood of it starves the others)."""

    def key(self, rank: int, oldest_ms: int, now_ms: int) -> tuple:
        return (rank, oldest_ms)


@dataclass(frozen=True)
class AgingTiers:
    """A tier climbs one rank for every `aging_ms` its oldest request has waited, up to the best
    rank; tiers of equal rank go oldest first. So a request at the head of a tier of rank r,
    having waited r * aging_ms, goes before any request that arrived after it."""

    aging_ms: int

    def key(self, rank: int, oldest_ms: int, now_ms: int) -> tuple:
        climbed = max(0, now_ms - oldest_ms) // self.aging_ms
        return (max(0, rank - climbed), oldest_ms, rank)


def tier_policy(name: str, aging_ms: int) -> StrictTiers | AgingTiers:
    if name == "strict":
        return StrictTiers()
    if name == "aging":
        return AgingTiers(aging_ms)
    raise ValueError(f"unknown tier policy {name!r}")


def preemptible_tiers(tiers: list[str], tier: str, free_slots: int) -> tuple[str, ...]:
    """The tiers whose running sequences a request of `tier` (the head of a dispatch round that
    placed nothing) may have preempted (--preempt-lower-tiers): those below its own, best first,
    and only while no decode slot is free anywhere. A request of the worst tier preempts nobody,
    so a preempted request never preempts back."""
    if free_slots > 0 or tier not in tiers:
        return ()
    return tuple(tiers[tiers.index(tier) + 1:])
