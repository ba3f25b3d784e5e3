"""When requests are offered: all at once, Poisson at a rate (open loop), or a closed loop.

Open loop (all at once, Poisson): request i is due at `offsets(n)[i]` seconds after the start,
whatever the server does; its latency counts from that due time, so a slow client or server
cannot hide queueing (no coordinated omission). Closed loop: `concurrency` requests are in
flight at all times; each starts when one ends, and its latency counts from when it is sent.
"""

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrivals:
    """rate: requests/s of a Poisson process (inf = all at once); concurrency: > 0 = closed loop."""

    rate: float = math.inf
    concurrency: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf = all at once), got {self.rate}")
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    @property
    def kind(self) -> str:
        return "closed" if self.concurrency else "all" if math.isinf(self.rate) else "poisson"

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"C={self.concurrency}"
        return "all" if self.kind == "all" else f"{self.rate:g}/s"

    def offered(self) -> dict:
        """JSON form: {"arrivals", "rate_per_s" (null = unbounded), "concurrency" (null = open loop)}."""
        return {"arrivals": self.kind, "rate_per_s": None if math.isinf(self.rate) or self.concurrency else self.rate,
                "concurrency": self.concurrency or None}

    def offsets(self, n: int) -> list[float] | None:
        """Due times in seconds from the start, in request order (None for a closed loop)."""
        if self.concurrency:
            return None
        if math.isinf(self.rate):
            return [0.0] * n
        rng = random.Random(f"pdq-bench/arrivals/{self.seed}/{self.rate}")
        t, out = 0.0, []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate)
        return out


def parse_rates(text: str) -> list[float]:
    """"1,2,4,inf" -> [1.0, 2.0, 4.0, inf]."""
    try:
        rates = [math.inf if part.strip().lower() in ("inf", "all") else float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"rates must be numbers or 'inf', comma separated, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0, got {text!r}")
    return rates


def parse_concurrency(text: str) -> list[int]:
    """"1,8,32" -> [1, 8, 32]."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"concurrency must be integers, comma separated, got {text!r}") from None
    if not values or any(c < 1 for c in values):
        raise ValueError(f"concurrency must be >= 1, got {text!r}")
    return values
