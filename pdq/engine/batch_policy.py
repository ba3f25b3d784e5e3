"""Iteration-level batch policy: which sequences run in the next step, and how many tokens each.

Pure: takes plain data about sequences and free KV blocks, returns a `StepPlan`. No torch, no
IO; the engine core (`pdq.engine.core`) drives it (the workers' loops batch with `pdq.engine.batching`
and `prefill_worker.chunking`).

Policy (decode first, then chunked prefill, FCFS, under a per-step token budget):
1. every running sequence with exactly one uncached token decodes it (1 token each);
2. running sequences partway through their prompt get their next chunk;
3. waiting sequences are admitted in order while their KV blocks, a seat (max_num_seqs) and
   budget remain; each gets its first chunk this same step (from the end of the prefix the
   cache already holds for it).
A chunk is at most `prefill_chunk` tokens; all tokens of a step are at most `max_batched_tokens`.
"""

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


class SeqView(NamedTuple):
    """What the policy knows of a sequence: tokens known (prompt + generated) and how many of
    them already have K/V in the pool (for a waiting one: found in the prefix cache).
    `num_tokens - num_cached` tokens are still to run; a waiting sequence needs `blocks` free
    KV blocks to be admitted. (Named tuples, as `Chunk`: the core makes one per running
    sequence every step, ~3x cheaper than a frozen dataclass.)"""

    seq_id: Hashable
    num_tokens: int
    num_cached: int = 0
    blocks: int = 0


class Chunk(NamedTuple):
    """Run positions [start, start + length) of `seq_id` as a prefill chunk."""

    seq_id: Hashable
    start: int
    length: int


@dataclass(frozen=True)
class StepPlan:
    """One step's decisions. `admit` lists waiting sequences to give KV blocks before running
    (they also appear in `prefill`). `num_tokens` = len(decode) + total prefill length."""

    decode: list[Hashable] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    admit: list[Hashable] = field(default_factory=list)
    num_tokens: int = 0

    def __bool__(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True)
class BatchPolicy:
    """max_batched_tokens: token budget of one forward; prefill_chunk: max prompt tokens of one
    sequence per step; max_num_seqs: max sequences holding KV at once (running)."""

    max_batched_tokens: int = 1024
    prefill_chunk: int = 512
    max_num_seqs: int = 256

    def __post_init__(self):
        for name in ("max_batched_tokens", "prefill_chunk", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def schedule(self, running: Iterable[SeqView], waiting: Iterable[SeqView], free_blocks: int,
                 budget: int | None = None) -> StepPlan:
        """Plan one step. `running`: sequences holding KV blocks, in priority (FCFS) order, each
        with room for its next token; `waiting`: sequences without, in admission order;
        `free_blocks`: KV blocks free; `budget`: this step's tokens, if fewer than
        `max_batched_tokens` (a colocated step's prompt part)."""
        running = list(running)
        budget = self.max_batched_tokens if budget is None else min(budget, self.max_batched_tokens)
        total = budget
        decode: list[Hashable] = []
        prefill: list[Chunk] = []
        admit: list[Hashable] = []
        partial = []
        for s in running:
            pending = s.num_tokens - s.num_cached
            if pending == 1 and budget:
                decode.append(s.seq_id)
                budget -= 1
            elif pending > 1:
                partial.append(s)
        for s in partial:
            if not budget:
                break
            n = min(s.num_tokens - s.num_cached, self.prefill_chunk, budget)
            prefill.append(Chunk(s.seq_id, s.num_cached, n))
            budget -= n
        seats = self.max_num_seqs - len(running)
        for s in waiting:
            if not budget or seats <= 0 or s.blocks > free_blocks:
                break
            n = min(s.num_tokens - s.num_cached, self.prefill_chunk, budget)
            if n <= 0:
                raise ValueError(f"waiting sequence {s.seq_id!r} has no token to run")
            admit.append(s.seq_id)
            prefill.append(Chunk(s.seq_id, s.num_cached, n))
            budget -= n
            seats -= 1
            free_blocks -= s.blocks
        return StepPlan(decode, prefill, admit, total - budget)


def waits_for_shared_prefix(prompt: list[int], cached: Callable[[], int], computing: list[list[int]],
                            block_size: int) -> bool:
    """Whether a prompt not yet admitted should wait for a pass: one of the prompts this pass
    computes (`computing`) will, once its blocks are written and named, hold more of this
    prompt's leading full blocks than the prefix cache holds now (`cached()` tokens, asked only
    when a computing prompt shares its first block). Waiting one pass then skips their prefill
    (n choices of one prompt, a burst sharing a system prompt) instead of computing the same
    blocks twice in one pass. Only blocks the cache could give it count: full ones, before its
    last token."""
    usable = (len(prompt) - 1) // block_size * block_size
    first = prompt[:block_size]
    computing = [other for other in computing if usable and other[:block_size] == first]
    if not computing:
        return False
    held = cached()
    start = held - held % block_size
    for other in computing:
        at = start
        while at + block_size <= min(usable, len(other)) and prompt[at:at + block_size] == other[at:at + block_size]:
            at += block_size
        if at > start and prompt[:start] == other[:start]:
            return True
    return False
