"""Batching strategies of the decode loop, as pure admission rules.

- continuous (default): iteration-level; a sequence joins at the first step after its KV
  arrives and leaves the step it finishes.
- dynamic: request-level; when no batch runs, start one as soon as `batch_size` sequences
  wait or the oldest has waited `window_ms`, whichever comes first; it runs to completion.
- static: request-level; start a batch of exactly `batch_size` (or whatever waits after
  `flush_ms`, so a tail is not stuck); it runs to completion.

Request-level batches run to completion as naive servers run them: a finished sequence keeps
its seat (its forward work is wasted) until the last one of its batch ends. That waste is
what `padding` counts.
"""

from dataclasses import dataclass

from pdq.config import STRATEGIES


@dataclass(frozen=True)
class Strategy:
    name: str = "continuous"
    batch_size: int = 8
    window_ms: float = 50.0
    flush_ms: float = 2000.0

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.name!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def run_to_completion(self) -> bool:
        return self.name != "continuous"

    def admit(self, waiting: int, running: int, oldest_wait_ms: float) -> int:
        """How many of the waiting sequences (in arrival order) join the batch now."""
        if waiting == 0:
            return 0
        if self.name == "continuous":
            return waiting
        if running:
            return 0
        limit = self.window_ms if self.name == "dynamic" else self.flush_ms
        if waiting >= self.batch_size or oldest_wait_ms >= limit:
            return min(waiting, self.batch_size)
        return 0

    def wait_hint_ms(self, oldest_wait_ms: float) -> float:
        """How long the loop may sleep before `admit` could change its answer with no arrival."""
        if self.name == "continuous":  # it admits everything at once: no reason to wait
            return 0.0
        limit = self.window_ms if self.name == "dynamic" else self.flush_ms
        return max(0.0, limit - oldest_wait_ms)
