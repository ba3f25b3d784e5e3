"""Inside one tenant: which of its queued requests goes first.

Each policy maps a request to its score in its tenant's queue (a Redis zset, lowest first). The
score is computed once, at submit, and kept when the request is requeued, so a request that
failed on a worker goes back to its old place. Scores are exact in a double: arrival numbers
below 2**32 (sjf) or 2**52 (fcfs, edf), prompt + max_tokens below 2**20.
"""

from collections.abc import Callable

OrderPolicy = Callable[[int, int, int, int], float]

NO_DEADLINE = 1 << 52  # after every real deadline (ms); requests without one keep arrival order
_TOKENS_CAP = (1 << 20) - 1


def fcfs(seq: int, prompt_tokens: int, max_tokens: int, deadline_ms: int) -> float:
    """First come, first served: the arrival number."""
    return seq


def sjf(seq: int, prompt_tokens: int, max_tokens: int, deadline_ms: int) -> float:
    """Shortest job first: prompt + max_tokens, ties by arrival."""
    return (min(prompt_tokens + max_tokens, _TOKENS_CAP) << 32) + (seq & 0xFFFFFFFF)


def edf(seq: int, prompt_tokens: int, max_tokens: int, deadline_ms: int) -> float:
    """Earliest deadline first; requests without a deadline after all others, by arrival."""
    return deadline_ms if deadline_ms > 0 else NO_DEADLINE + seq


ORDER_POLICIES: dict[str, OrderPolicy] = {"fcfs": fcfs, "sjf": sjf, "edf": edf}
