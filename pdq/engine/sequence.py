"""One generation's token state, as the engine loop sees it."""

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from pdq.engine.batch_policy import SeqView
from pdq.engine.sampling import SamplingParams


def end_reason(params: SamplingParams, token: int, eos_ids, generated: int, position: int, max_seq_len: int,
               stopped: bool = False, complete: bool = False) -> str:
    """Why an output ends with `token`, its `generated`-th token, at KV position `position`; ""
    while it goes on. "stop": a stop string matched (`stopped`, matched on text by the caller) or
    the structured output is complete (`complete`); "eos": an EOS token (unless ignore_eos) or a
    stop token id; "length": max_tokens reached, or no room is left in the context. The one rule
    of every worker's step (prefill's first token, decode's others)."""
    if stopped:
        return "stop"
    reason = params.finish(token, eos_ids)
    if reason:
        return reason
    if complete:
        return "stop"
    return "length" if generated >= params.max_tokens or position + 1 >= max_seq_len else ""


class SeqStatus(enum.IntEnum):
    """A sequence's place in the engine core, in order."""

    WAITING = 0  # no KV blocks: new, or preempted (its output so far is kept and recomputed)
    RUNNING = 1  # holds KV blocks: prefilling its prompt in chunks, then decoding a token a step
    FINISHED = 2  # ended (finish_reason says why); its blocks are freed


@dataclass(eq=False)
class Sequence:
    """prompt + output tokens; `num_cached` of them have K/V in the pool (or are being written
    by the step planned). The one sequence type of the engine core (`pdq.engine.core`).

    finish_reason: None while running, then "eos" (an EOS token, unless params.ignore_eos, or one
    of params.stop_token_ids was sampled and is the last output token), "length" (max_tokens
    reached, or the context is full) or what ended it from outside ("stop", "cancelled", ...).
    priority: smaller is more important (e.g. (tier rank, fair-share position)); the core
    preempts the largest first, then the newest.
    """

    seq_id: Hashable
    prompt: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    status: SeqStatus = SeqStatus.WAITING
    priority: tuple = ()
    waiting_since: float = 0.0  # clock time it (re)entered the waiting queue
    reserve_tokens: int = 0  # KV positions to hold from admission on, if more than its tokens (room to grow)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, pos: int) -> int:
        n = len(self.prompt)
        return self.prompt[pos] if pos < n else self.output[pos - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        if end <= len(self.prompt):
            return self.prompt[start:end]
        return (self.prompt + self.output)[start:end]

    def view(self) -> SeqView:
        return SeqView(self.seq_id, self.num_tokens, self.num_cached)
