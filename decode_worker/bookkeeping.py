"""A decode step's bookkeeping, apart from its effects.

`update` takes the step's sequences and the tokens sampled for them and decides, with no IO:
which tokens go to Redis now (a sequence with stream interval N holds its tokens until a step
whose count is a multiple of N, or its end), which sequences end and why (`end_reason`: a stop
string, EOS or a stop token, a complete grammar, max_tokens, a full context), which failed (their
sampling raised: the request alone fails), and which seats were kept for finished sequences
(request-level strategies' waste). It advances each sequence's own state (its tokens, text,
grammar matcher and held tokens): plain data. `DecodeLoop.after` applies the plan: the Redis
send, freeing K/V, spans, metrics.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdq.engine.constraint import advance
from pdq.engine.sequence import end_reason
from pdq.state.request import State
from pdq.state.store import StepItem

if TYPE_CHECKING:
    from decode_worker.loop import Sequence


@dataclass
class StepPlan:
    items: list[StepItem] = field(default_factory=list)  # written to Redis now, in order
    owners: list["Sequence | None"] = field(default_factory=list)  # each item's sequence; None: it ended
    live: list[tuple["Sequence", str]] = field(default_factory=list)  # sequences that took a token, and
    # their end reason ("" = they go on), in step order
    failed: list[tuple["Sequence", str]] = field(default_factory=list)  # sampling failed: (sequence, error)
    wasted: int = 0  # seats kept for finished sequences (request-level strategies)

    @property
    def ended(self) -> list["Sequence"]:
        return [seq for seq, reason in self.live if reason]


def update(seqs: list["Sequence"], tokens: list[Any], records: list[Any], step: int, eos_ids: Any,
           max_seq_len: int, current: Callable[["Sequence"], bool]) -> StepPlan:
    """One step's outcome: `tokens[i]` (a token id, or the exception its sampling raised) and
    `records[i]` (its logprobs record, or None) belong to `seqs[i]`; `step` is the step's count
    (stream intervals flush on its multiples); `current(seq)` says whether the sequence is still
    running (it may have left when the previous step settled: it is skipped)."""
    plan = StepPlan()
    for seq, token, record in zip(seqs, tokens, records):
        if not current(seq):
            continue
        if isinstance(token, Exception):
            plan.failed.append((seq, f"sampling failed: {token}"))
            continue
        seq.generated.append(token)
        if seq.done:  # a seat kept for a finished sequence
            plan.wasted += 1
            continue
        delta, stopped = seq.text.add(token)
        complete = advance(seq.matcher, token)
        reason = end_reason(seq.params, token, eos_ids, len(seq.generated), seq.position, max_seq_len, stopped,
                            complete)
        if reason and reason != "stop":
            delta += seq.text.flush()
        seq.held.append(StepItem(seq.rid, seq.epoch, len(seq.generated) - 1, token, delta,
                                 State.COMPLETED if reason else None, reason, record))
        if reason or step % seq.interval == 0:  # every N steps, all such sequences at once
            plan.items += seq.held
            plan.owners += [None if reason else seq] * len(seq.held)
            seq.held.clear()
        plan.live.append((seq, reason or ""))
    return plan
