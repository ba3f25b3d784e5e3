"""A decode step's bookkeeping, apart from its effects.

`judge` decides what one sampled token means for its sequence (its text, a stop string, a
complete grammar, EOS or a stop token, max_tokens, a full context): the engine core calls it
for each token it appends (`EngineCore.update(..., judge=...)`). `writes` takes the core's step
outputs and decides, with no IO, which tokens go to Redis now: a sequence with stream interval N
holds its tokens until a step whose count is a multiple of N, or its end. Both advance each
sequence's own state (its text, grammar matcher and held tokens): plain data. `DecodeLoop.after`
applies the plan: the Redis send, spans, metrics.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdq.engine.constraint import advance
from pdq.engine.sequence import end_reason
from pdq.state.request import State
from pdq.state.store import StepItem

if TYPE_CHECKING:
    from decode_worker.loop import Sequence
    from pdq.engine.core import StepOutput


@dataclass
class StepPlan:
    items: list[StepItem] = field(default_factory=list)  # written to Redis now, in order
    owners: list["Sequence | None"] = field(default_factory=list)  # each item's sequence; None: it ended
    live: list[tuple["Sequence", str]] = field(default_factory=list)  # sequences that took a token, and
    # their end reason ("" = they go on), in step order

    @property
    def ended(self) -> list["Sequence"]:
        return [seq for seq, reason in self.live if reason]


def judge(seq: "Sequence", token: int, eos_ids: Any, max_seq_len: int) -> str:
    """Why `seq` ends with `token`, just appended to its output ("" = it goes on); its text delta
    (what the client sees of it) is left in `seq.delta`."""
    delta, stopped = seq.text.add(token)
    complete = advance(seq.matcher, token)
    reason = end_reason(seq.params, token, eos_ids, len(seq.output), seq.num_tokens - 1, max_seq_len, stopped,
                        complete)
    if reason and reason != "stop":
        delta += seq.text.flush()
    seq.delta = delta
    return reason


def writes(outputs: Iterable["StepOutput"], records: dict[int, Any], step: int) -> StepPlan:
    """One step's writes: each output's token (its logprobs record in `records`, by the
    sequence's id(), or None), held or written now; `step` is the step's count (stream
    intervals flush on its multiples)."""
    plan = StepPlan()
    for out in outputs:
        seq, token, reason = out.seq, out.token, out.finish_reason
        seq.held.append(StepItem(seq.rid, seq.epoch, len(seq.output) - 1, token, seq.delta,
                                 State.COMPLETED if reason else None, reason, records.get(id(seq))))
        if reason or step % seq.interval == 0:  # every N steps, all such sequences at once
            plan.items += seq.held
            plan.owners += [None if reason else seq] * len(seq.held)
            seq.held.clear()
        plan.live.append((seq, reason))
    return plan
