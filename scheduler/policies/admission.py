"""Admission: the tier a request may use and the retry hint given when the queue is full."""

import collections
from dataclasses import dataclass, field


def resolve_tier(requested: str, allowed: str | None, tiers: list[str]) -> str | None:
    """The tier a request runs in: the requested one (default: the best), but no better than the
    tenant's `allowed` tier. -> None when the requested tier is unknown."""
    tier = requested or tiers[0]
    if tier not in tiers:
        return None
    if allowed in tiers and tiers.index(allowed) > tiers.index(tier):
        return allowed
    return tier


def kv_misfit(prompt_tokens: int, max_tokens: int, pools: list[int]) -> str:
    """Why a request can never run: prompt + max_tokens needs more KV positions than the largest
    decode worker's pool holds (`pools`: each live decode worker's total KV positions; none known
    yet: nothing is refused). -> "" when it fits. Such a request would wait for a reservation that
    is never granted, or be preempted again and again as its output grew."""
    largest = max(pools, default=0)
    need = prompt_tokens + max_tokens
    if not largest or need <= largest:
        return ""
    return (f"the {prompt_tokens}-token prompt plus max_tokens {max_tokens} needs {need} KV positions, and the "
            f"largest decode worker's KV pool holds {largest} (--kv-budget-tokens); shorten the prompt or "
            f"max_tokens to at most {largest} together")


def retry_after_ms(drain_tokens: int, tokens_per_s: float, min_ms: int, max_ms: int) -> int:
    """How long until `drain_tokens` queued tokens have left at the recent dispatch rate,
    clamped to [min_ms, max_ms]; max_ms when nothing has been dispatched lately."""
    if tokens_per_s <= 0:
        return max_ms
    return int(min(max_ms, max(min_ms, 1000 * drain_tokens / tokens_per_s)))


@dataclass
class DrainRate:
    """Tokens dispatched per second over the last `window_s` seconds."""

    window_s: float = 10.0
    _events: collections.deque = field(default_factory=collections.deque)
    _total: int = 0

    def add(self, now_s: float, tokens: int) -> None:
        self._events.append((now_s, tokens))
        self._total += tokens
        self._trim(now_s)

    def rate(self, now_s: float) -> float:
        self._trim(now_s)
        return self._total / self.window_s

    def _trim(self, now_s: float) -> None:
        while self._events and self._events[0][0] < now_s - self.window_s:
            self._total -= self._events.popleft()[1]
