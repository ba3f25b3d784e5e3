"""EngineCore: one step of a batch of sequences, in three calls (nano-vllm's and vLLM v1's shape).

    plan = core.schedule()                  # who runs, which prompt chunks, who was preempted
    logits = runner.step(*plan.items())     # the forward (the caller's: the model is not here)
    outputs = core.update(plan, tokens)     # the sampled tokens -> who took what, who finished

The core owns the sequences (`pdq.engine.sequence.Sequence`, one `SeqStatus` each) and their KV
blocks (through the `ModelRunner`'s pool: allocation, prefix-cache lookups, freeing). It decides
and keeps books; it runs no model, samples nothing and does no IO, so the in-process engine and
a worker's loop feed it the same way, and tests drive it with made-up tokens.

`schedule()`:
1. makes room for every running sequence's next token: while the blocks are not free, the least
   important running sequence (`victim`: highest `priority`, then the newest) is preempted by
   recompute: its blocks freed, it goes back to the head of the waiting queue (or, with
   `requeue_preempted=False`, out to the caller in `plan.preempted`);
2. unless it preempted, admits waiting sequences by the batching `Strategy` (continuous: all that fit; static and
   dynamic: a whole batch when none runs, optionally length-bucketed) and by free KV blocks,
   the prefix cache's blocks shared (a prompt skips its cached part);
3. plans the step with the `BatchPolicy`: every decode row, then prompt chunks under the
   per-step token budget.
`update()` appends each sampled token, ends a sequence on EOS / a stop token / max_tokens / a full
context, frees its blocks and reports it. `finish(seq_id, reason)` ends one from outside (a stop
string the caller matched on text, a cancel, a deadline).
"""

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from pdq.engine.batch_policy import BatchPolicy, Chunk
from pdq.engine.batching import Strategy
from pdq.engine.blocks import KVPoolFull
from pdq.engine.runner import DecodeItem, ModelRunner, PrefillItem
from pdq.engine.sequence import Sequence, SeqStatus, end_reason


@dataclass
class ScheduledChunk:
    """Prompt positions [start, start + length) of `seq` run this step."""

    seq: Sequence
    start: int
    length: int


@dataclass
class CorePlan:
    """One step: `prefill` chunks, then `decode` rows, as the forward's logits rows come; the
    logits of `sample` (a sub-list, in row order) are sampled. `preempted`: sequences preempted
    to make room (with `requeue_preempted=False`, theirs to place elsewhere)."""

    prefill: list[ScheduledChunk] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def sample(self) -> list[Sequence]:
        rows = [c.seq for c in self.prefill] + self.decode
        return [rows[i] for i in self.sample_rows]

    def items(self) -> tuple[list[PrefillItem], list[DecodeItem]]:
        """The forward's inputs (`ModelRunner.step`)."""
        return ([PrefillItem(c.seq.seq_id, c.seq.tokens(c.start, c.start + c.length), c.start) for c in self.prefill],
                [(s.seq_id, s.token_at(s.num_cached - 1), s.num_cached - 1) for s in self.decode])


@dataclass(frozen=True)
class StepOutput:
    """`seq` took `token`; `finish_reason` is "" while it goes on."""

    seq: Sequence
    token: int
    finish_reason: str = ""


class EngineCore:
    def __init__(self, runner: ModelRunner, policy: BatchPolicy = BatchPolicy(),
                 strategy: Strategy = Strategy(), requeue_preempted: bool = True,
                 clock=time.monotonic):
        self.runner = runner
        self.policy = policy
        self.strategy = strategy
        self.requeue_preempted = requeue_preempted
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Hashable, Sequence] = {}  # insertion order = admission order
        self.preemptions = 0
        self._wanted = False  # the last admission wanted to admit someone

    # -- in ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (prompt, and tokens an earlier attempt generated, in `output`)."""
        seq.status = SeqStatus.WAITING
        seq.num_cached = 0
        seq.waiting_since = self.clock()
        self.waiting.append(seq)

    def finish(self, seq_id: Hashable, reason: str) -> Sequence | None:
        """Ends a waiting or running sequence from outside (`reason`: "stop", "cancelled", ...)
        and frees its blocks. -> it, or None if the core does not hold it."""
        seq = self.running.pop(seq_id, None)
        if seq is None:
            seq = next((s for s in self.waiting if s.seq_id == seq_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)
        self._end(seq, reason)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ------------------------------------------------------------------------------

    def schedule(self) -> CorePlan:
        plan = CorePlan()
        self._wanted = False
        self._make_room(plan)
        admitted = self._admit() if not plan.preempted else []  # as vLLM: none joins a step that preempted
        new = {id(s) for s in admitted}
        step = self.policy.schedule((s.view() for s in self.running.values() if id(s) not in new),
                                    [], self.runner.free_blocks)
        budget = self.policy.max_batched_tokens - step.num_tokens
        chunks = list(step.prefill)
        for seq in admitted:  # admitted this step: their first chunk in the budget left
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_cached, self.policy.prefill_chunk, budget)
            chunks.append(Chunk(seq.seq_id, seq.num_cached, n))
            budget -= n
        for c in chunks:
            seq = self.running[c.seq_id]
            plan.prefill.append(ScheduledChunk(seq, c.start, c.length))
            seq.num_cached = c.start + c.length
            if seq.num_cached == seq.num_tokens:
                plan.sample_rows.append(len(plan.prefill) - 1)
        for seq_id in step.decode:
            seq = self.running[seq_id]
            plan.decode.append(seq)
            seq.num_cached += 1
        plan.sample_rows += range(len(plan.prefill), len(plan.prefill) + len(plan.decode))
        if not plan and self.waiting and not self.running and self._wanted:
            raise RuntimeError("cannot schedule any waiting sequence (no KV blocks or seat)")
        return plan

    def wait_hint_s(self) -> float:
        """With nothing to run, how long until `schedule()` may admit with no arrival (a
        request-level strategy's window)."""
        if self.running or not self.waiting:
            return 0.0
        return self.strategy.wait_hint_ms((self.clock() - self.waiting[0].waiting_since) * 1000) / 1000

    def victim(self) -> Sequence:
        """The running sequence preempted first: the least important `priority`, then the newest."""
        order = {seq_id: i for i, seq_id in enumerate(self.running)}
        return max(self.running.values(), key=lambda s: (s.priority, order[s.seq_id]))

    def _make_room(self, plan: CorePlan) -> None:
        """Blocks for every decoding sequence's next token; while they are not free, the
        `victim` is preempted by recompute (which may be that sequence itself)."""
        for seq in list(self.running.values()):
            if self.running.get(seq.seq_id) is not seq or seq.num_tokens - seq.num_cached != 1:
                continue
            while self.running.get(seq.seq_id) is seq:
                try:
                    self.runner.ensure(seq.seq_id, seq.num_tokens)
                    break
                except KVPoolFull:
                    self._preempt(self.victim(), plan)

    def _preempt(self, seq: Sequence, plan: CorePlan) -> None:
        del self.running[seq.seq_id]
        self.runner.free(seq.seq_id)
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        self.preemptions += 1
        plan.preempted.append(seq)
        if self.requeue_preempted:
            seq.waiting_since = self.clock()
            self.waiting.appendleft(seq)

    def _admit(self) -> list[Sequence]:
        """Waiting sequences given KV blocks this step (in order), as the strategy, the seats
        (`max_num_seqs`), the token budget and the free blocks allow."""
        self._wanted = False
        if not self.waiting:
            return []
        strategy, policy, runner = self.strategy, self.policy, self.runner
        oldest_ms = (self.clock() - self.waiting[0].waiting_since) * 1000
        n = strategy.admit(len(self.waiting), len(self.running), oldest_ms)
        n = min(n, policy.max_num_seqs - len(self.running))
        if n <= 0:
            return []
        self._wanted = True
        picked = strategy.pick([s.num_tokens + s.params.max_tokens - len(s.output) for s in self.waiting], n)
        candidates = [self.waiting[i] for i in picked]
        budget = policy.max_batched_tokens - sum(1 for s in self.running.values() if s.num_tokens - s.num_cached == 1)
        admitted = []
        for seq in candidates:
            if budget <= 0 and not strategy.run_to_completion:  # a request-level batch starts whole
                break
            tokens = seq.tokens(0, seq.num_tokens)
            try:
                seq.num_cached = runner.allocate(seq.seq_id, tokens)
            except KVPoolFull:  # no blocks: it waits (in order: the ones behind it wait too)
                break
            budget -= min(seq.num_tokens - seq.num_cached, policy.prefill_chunk)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            admitted.append(seq)
        return admitted

    # -- update --------------------------------------------------------------------------------

    def update(self, plan: CorePlan, tokens: list[int]) -> list[StepOutput]:
        """`tokens[i]`: the token sampled for `plan.sample[i]`. -> what each of them took; those
        that finished have left (blocks freed, status FINISHED)."""
        outputs = []
        max_seq_len = self.runner.max_seq_len
        for seq, token in zip(plan.sample, tokens):
            if self.running.get(seq.seq_id) is not seq:  # ended meanwhile (finish())
                continue
            seq.output.append(token)
            reason = end_reason(seq.params, token, seq.eos_token_ids, len(seq.output), seq.num_tokens - 1,
                                max_seq_len)
            if reason:
                del self.running[seq.seq_id]
                self._end(seq, reason)
            outputs.append(StepOutput(seq, token, reason))
        return outputs

    def _end(self, seq: Sequence, reason: str) -> None:
        self.runner.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
