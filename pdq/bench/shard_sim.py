"""pdq over several shards, simulated (docs/scaling.md): does fair share survive sharding, and
does throughput grow with the number of shards? Pure and seeded: `python -m pdq.bench.shard_sim`.

A shard is one pdq queue (one Redis primary, one leading scheduler, its own worker pool) that
serves `capacity` tokens (prompt + output) per tick. Each shard orders its tenants with the real
fair-share policy (`scheduler.policies.fair.VTC`: lowest counter first, charged (prompt +
max_tokens) / weight per request), and lifts a tenant that joins its backlog to the lowest
backlogged counter (or the floor) as `pdq/lua/lib.lua` does. Tenants reach shards by a placement:

- `one`: a single shard with all the capacity: one Redis big enough (the reference);
- `pinned-hash`: each tenant on one shard, crc32(tenant) % shards (a map nobody tuned);
- `pinned-balanced`: each tenant on one shard, largest fair share first onto the shard with the
  least fair share so far (a map an operator keeps from the tenants' weights and demand);
- `spread`: every request on the shard its id hashes to; counters per shard.

`sticky` runs put a few tenants on shard 0 only and spread the rest, with `exchange_every` > 0
adding what other shards served each tenant (tokens / weight, as of the last exchange) to its
counter on every shard: the periodic counter exchange of docs/scaling.md.

A tenant's share of service is its tokens served per tick after `warmup`, against its fair share:
weighted max-min over all shards' capacity of what it offered in that window, its queue at the
window's start included (a tenant asking for less than its weight's share gets what it asks; the
rest is split by weight among the others).
"""

import argparse
import math
import random
import zlib
from dataclasses import dataclass, field

from scheduler.policies.batch import Candidate
from scheduler.policies.fair import VTC, TenantQueue

PLACEMENTS = ("one", "pinned-hash", "pinned-balanced", "spread")
PROMPTS = (64, 128, 256, 512)
OUTPUTS = (32, 64, 128, 256)
MEAN_COST = sum(PROMPTS) / len(PROMPTS) + sum(OUTPUTS) / len(OUTPUTS)  # tokens of a request, on average


@dataclass(frozen=True)
class TenantLoad:
    name: str
    weight: float
    demand: float  # tokens per tick it offers


@dataclass(frozen=True)
class Outcome:
    """One run: each tenant's tokens per tick (after warmup) against its fair share."""

    placement: str
    shards: int
    capacity: float  # all shards together, tokens per tick
    got: dict[str, float]
    fair: dict[str, float]

    @property
    def throughput(self) -> float:
        return sum(self.got.values())

    @property
    def utilization(self) -> float:
        return self.throughput / self.capacity

    @property
    def max_error(self) -> float:
        """The largest |served - fair| / fair over the tenants."""
        return max(abs(self.got[t] - f) / f for t, f in self.fair.items())

    @property
    def jain(self) -> float:
        """Jain's index of served / fair: 1 when every tenant gets the same fraction of its share."""
        x = [self.got[t] / f for t, f in self.fair.items()]
        return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def fair_shares(tenants: list[TenantLoad], capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of `capacity` (water-filling over the tenants' demands)."""
    shares, left, active = {}, capacity, list(tenants)
    while active:
        level = left / sum(t.weight for t in active)
        content = [t for t in active if t.demand <= level * t.weight]
        if not content:
            shares.update({t.name: level * t.weight for t in active})
            break
        for t in content:
            shares[t.name] = t.demand
            left -= t.demand
        active = [t for t in active if t not in content]
    return shares


@dataclass
class Shard:
    """One shard's queue: a TenantQueue per tenant (its counter is the VTC counter plus the other
    shards' service as of the last exchange), the backlog, the floor, and unspent capacity."""

    capacity: float
    queues: dict[str, TenantQueue] = field(default_factory=dict)
    backlog: list[TenantQueue] = field(default_factory=list)
    floor: float = 0.0
    budget: float = 0.0
    served: dict[str, float] = field(default_factory=dict)  # tokens / weight served here
    remote: dict[str, float] = field(default_factory=dict)  # tokens / weight the other shards served

    def enqueue(self, cand: Candidate, weight: float) -> None:
        q = self.queues.get(cand.tenant)
        if q is None:
            q = self.queues[cand.tenant] = TenantQueue(cand.tenant, 0.0, weight, [])
        if not q.waiting:  # joins the backlog: lifted, so idle time banks no credit (lib.lua enqueue)
            low = min((b.counter for b in self.backlog), default=self.floor)
            q.counter = max(q.counter, low)
            q.heads, q.taken = [], 0
            self.backlog.append(q)
        q.heads.append(cand)

    def serve(self, policy: VTC) -> list[tuple[str, int]]:
        """One tick: dispatches in the policy's order while the tick's capacity lasts; a request
        that does not fit waits for the next tick (nothing overtakes it, as in `form_batch`).
        -> (tenant, tokens) of each request dispatched."""
        self.budget += self.capacity
        out = []
        while self.backlog:
            q = policy.pick(self.backlog)
            cost = q.head.kv_tokens
            if cost > self.budget:
                return out
            policy.charge(q, q.take())
            self.served[q.tenant] = self.served.get(q.tenant, 0.0) + cost / q.weight
            self.budget -= cost
            out.append((q.tenant, cost))
            if not q.waiting:  # leaves the backlog (lib.lua unqueue)
                self.backlog.remove(q)
                if not self.backlog:
                    self.floor = q.counter
        self.budget = 0.0  # idle capacity is not saved up
        return out


def exchange(shards: list[Shard]) -> None:
    """Each shard learns what the others served each tenant, and adds what is new to its counter."""
    total: dict[str, float] = {}
    for s in shards:
        for t, v in s.served.items():
            total[t] = total.get(t, 0.0) + v
    for s in shards:
        for t, q in s.queues.items():
            remote = total.get(t, 0.0) - s.served.get(t, 0.0)
            q.counter += remote - s.remote.get(t, 0.0)
            s.remote[t] = remote


def placement_map(tenants: list[TenantLoad], placement: str, shards: int,
                  fair: dict[str, float]) -> dict[str, int] | None:
    """Tenant -> shard for the pinned placements; None where each request is placed on its own."""
    if placement == "one":
        return {t.name: 0 for t in tenants}
    if placement == "pinned-hash":
        return {t.name: zlib.crc32(t.name.encode()) % shards for t in tenants}
    if placement == "pinned-balanced":
        load, out = [0.0] * shards, {}
        for t in sorted(tenants, key=lambda t: (-fair[t.name], t.name)):
            s = min(range(shards), key=lambda i: (load[i], i))
            out[t.name], load[s] = s, load[s] + fair[t.name]
        return out
    if placement == "spread":
        return None
    raise ValueError(f"unknown placement {placement!r}")


def poisson(rng: random.Random, mean: float) -> int:
    n, p, limit = 0, rng.random(), math.exp(-mean)
    while p > limit:
        n += 1
        p *= rng.random()
    return n


def simulate(tenants: list[TenantLoad], placement: str, shards: int, capacity: float = 2000.0,
             ticks: int = 600, warmup: int = 100, seed: int = 1, sticky: frozenset[str] = frozenset(),
             exchange_every: int = 0) -> Outcome:
    """Runs `ticks` ticks of seeded Poisson arrivals (`demand / MEAN_COST` requests per tick per
    tenant, sizes drawn from PROMPTS x OUTPUTS) over `shards` shards of `capacity` tokens per tick.
    Tenants in `sticky` send every request to shard 0 whatever the placement."""
    total = capacity * shards
    fair = fair_shares(tenants, total)
    pinned = placement_map(tenants, placement, shards, fair)
    queues = [Shard(total if placement == "one" else capacity) for _ in range(1 if placement == "one" else shards)]
    rng, policy, seq = random.Random(seed), VTC(), 0
    offered = {t.name: 0 for t in tenants}
    served = {t.name: 0 for t in tenants}
    for tick in range(ticks):
        counted = tick >= warmup
        if tick == warmup:  # what is queued as the window opens is demand in it too
            for q in (q for shard in queues for q in shard.backlog):
                offered[q.tenant] += sum(c.kv_tokens for c in q.heads[q.taken:])
        for t in tenants:
            for _ in range(poisson(rng, t.demand / MEAN_COST)):
                seq += 1
                rid = f"{t.name}-{seq}"
                cand = Candidate(rid, rng.choice(PROMPTS), rng.choice(OUTPUTS), t.name, created_ms=tick)
                if counted:
                    offered[t.name] += cand.kv_tokens
                if t.name in sticky:
                    s = 0
                elif pinned is not None:
                    s = pinned[t.name]
                else:
                    s = zlib.crc32(rid.encode()) % len(queues)
                queues[s].enqueue(cand, t.weight)
        for s in queues:
            for tenant, cost in s.serve(policy):
                served[tenant] += cost if counted else 0
        if exchange_every and (tick + 1) % exchange_every == 0:
            exchange(queues)
    window = ticks - warmup
    asked = [TenantLoad(t.name, t.weight, offered[t.name] / window) for t in tenants]
    return Outcome(placement, shards, total, {t: v / window for t, v in served.items()}, fair_shares(asked, total))


def mix(shards: int, capacity: float = 2000.0, load: float = 1.3) -> list[TenantLoad]:
    """16 tenants of weights 1, 2 and 4 whose demands span 0.25x to 4x of an even split,
    together offering `load` times the capacity of `shards` shards."""
    weights = (1, 1, 2, 4) * 4
    spread = (0.25, 0.5, 1.0, 4.0, 0.5, 2.0, 0.25, 1.0, 3.0, 0.25, 0.5, 2.0, 1.0, 4.0, 0.25, 0.5)
    scale = load * capacity * shards / sum(spread)
    return [TenantLoad(f"t{i:02d}", w, d * scale) for i, (w, d) in enumerate(zip(weights, spread))]


def backlogged(shards: int, capacity: float = 2000.0) -> list[TenantLoad]:
    """8 tenants of weights 1 to 4, each offering twice its weighted share of `shards` shards."""
    weights = (1, 1, 2, 4, 1, 2, 4, 1)
    return [TenantLoad(f"b{i}", w, 2 * w / sum(weights) * capacity * shards) for i, w in enumerate(weights)]


def sharding_table(shard_counts: tuple[int, ...] = (1, 2, 4, 8), seed: int = 1) -> list[Outcome]:
    """`mix` scaled with the shards (the same tenants, each sending `shards` times as much)."""
    return [simulate(mix(s), p, s, seed=seed) for s in shard_counts for p in PLACEMENTS if s > 1 or p == "one"]


STICKY = frozenset({"b0", "b1"})


def skew_table(shard_counts: tuple[int, ...] = (2, 4), seed: int = 1) -> list[tuple[str, Outcome]]:
    """`backlogged` with two tenants of weight 1 (b0, b1) sending only to shard 0 and the rest
    spread: per-shard counters alone, then with a counter exchange every 100 and every 10 ticks."""
    out = []
    for s in shard_counts:
        for every in (0, 100, 10):
            label = f"exchange every {every} ticks" if every else "per-shard counters"
            out.append((label, simulate(backlogged(s), "spread", s, seed=seed, sticky=STICKY, exchange_every=every)))
    return out


def _row(label: str, o: Outcome, base: float) -> str:
    return (f"| {o.shards} | {label} | {o.max_error * 100:.1f}% | {o.jain:.3f} | {o.throughput:,.0f} "
            f"| {o.throughput / base:.2f}x | {o.utilization * 100:.0f}% |")


def report(rows: list[Outcome], skewed: list[tuple[str, Outcome]]) -> str:
    """The two tables of docs/scaling.md, in Markdown; `rows` holds the one-shard reference."""
    head = ("| shards | placement | max error vs fair share | Jain's index | tokens/tick | vs 1 shard | utilization |\n"
            "|---|---|---|---|---|---|---|")
    base = next(o.throughput for o in rows if o.shards == 1 and o.placement == "one")
    return "\n".join([head, *(_row(o.placement, o, base) for o in rows), "",
                      head, *(_row(f"sticky + {label}", o, base) for label, o in skewed)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdq.bench.shard_sim", description="pdq over several shards, simulated: each tenant's service against its fair share, "
                                     "and throughput against the number of shards (docs/scaling.md)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(report(sharding_table(seed=args.seed), skew_table(seed=args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
