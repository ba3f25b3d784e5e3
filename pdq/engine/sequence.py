"""One generation's token state, as the engine loop sees it."""

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


@dataclass
class Sequence:
    """prompt + output tokens; `num_cached` of them have K/V in the pool.

    finish_reason: None while running, then "eos" (an EOS token, unless params.ignore_eos, or one
    of params.stop_token_ids was sampled and is the last output token) or "length" (max_tokens
    reached).
    """

    seq_id: Hashable
    prompt: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None

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

    def append(self, token: int) -> str | None:
        """Add a sampled token; returns (and records) the finish reason, if it finished."""
        self.output.append(token)
        if self.params.finish(token, self.eos_token_ids):
            self.finish_reason = "eos"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason
