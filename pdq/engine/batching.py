"""Batching strategies, as pure admission rules: which waiting sequences join the batch now.

- continuous (default): iteration-level; a sequence joins at the first step after it is ready
  and leaves the step it finishes.
- dynamic: request-level; when no batch runs, start one as soon as `batch_size` sequences
  wait or the oldest has waited `window_ms`, whichever comes first; it runs to completion.
- static: request-level; start a batch of exactly `batch_size` (or whatever waits after
  `flush_ms`, so a tail is not stuck); it runs to completion.

Request-level batches run to completion as naive servers run them: no sequence joins until the
last one of the batch has ended. With `bucket` (length bucketing, both request-level
strategies), a batch is the oldest waiting sequence and the waiting ones nearest to it in length
(prompt + output asked for), so a batch's sequences end at about the same step instead of one long
sequence keeping a batch of short ones' seats; the oldest always goes, so none starves.

The engine core (`pdq.engine.core`) and the decode worker's loop both batch by these rules.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from pdq.config import STRATEGIES


@dataclass(frozen=True)
class Strategy:
    name: str = "continuous"
    batch_size: int = 8
    window_ms: float = 50.0
    flush_ms: float = 2000.0
    bucket: bool = False  # request-level batches of similar lengths (see the module's docstring)

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.name!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def run_to_completion(self) -> bool:
        return self.name != "continuous"

    def admit(self, waiting: int, running: int, oldest_wait_ms: float) -> int:
        """How many of the waiting sequences join the batch now."""
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

    def pick(self, lengths: Sequence[int], n: int) -> list[int]:
        """Which `n` of the waiting sequences (their `lengths`, oldest first) join: the first n,
        or with `bucket` on a request-level strategy, the oldest and the n - 1 nearest to it in
        length (ties: the older). -> their indices, in waiting order."""
        if not self.bucket or not self.run_to_completion or n >= len(lengths):
            return list(range(min(n, len(lengths))))
        anchor = lengths[0]
        rest = sorted(range(1, len(lengths)), key=lambda i: (abs(lengths[i] - anchor), i))
        return sorted([0, *rest[:n - 1]])

    def wait_hint_ms(self, oldest_wait_ms: float) -> float:
        """How long the loop may sleep before `admit` could change its answer with no arrival."""
        if self.name == "continuous":  # it admits everything at once: no reason to wait
            return 0.0
        limit = self.window_ms if self.name == "dynamic" else self.flush_ms
        return max(0.0, limit - oldest_wait_ms)
