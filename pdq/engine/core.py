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
context (or on what the caller's `judge` says: stop strings matched on text, a complete grammar),
frees its blocks and reports it. `finish(seq_id, reason)` ends one from outside (a cancel, a
deadline, a failure of its own).

Request-level batches (static, dynamic) run as naive servers run them: a sequence that ends keeps
its seat, its blocks and a row in every step (computed, sampled and thrown away: `padded`; the row
recomputes its last position, so its output and its blocks stay as they ended) until the batch's
last sequence ends; then they all leave at once.

A decode worker's core is the same core fed differently: a sequence whose K/V arrived from a
prefill worker joins with `add_prefilled` (it holds its blocks already and needs no prefill), the
blocks promised to hand-offs still on their way are kept out of reach (`reserved_blocks`), the
victim rule sees what the worker knows (tiers, tenants), and preempted sequences go back to the
caller (`requeue_preempted=False`) to be requeued in the cluster. A prefill worker's core keeps
its prompts in priority order and runs only the most urgent that can run (`urgent_first`); a
prompt the pass completed leaves with its blocks (`detach`), to be handed off. With the prefix
cache on, a prompt whose leading blocks another prompt is computing waits a step for them
(`waits_for_shared_prefix`) instead of computing them twice. A prompt with one token left (past
its cached prefix, or a last chunk of one) runs as a one-token row among the decode rows.
"""

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdq.engine.batch_policy import BatchPolicy, Chunk, waits_for_shared_prefix
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
    held_back: list[Sequence] = field(default_factory=list)  # running, but no block for their next token

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def sample(self) -> list[Sequence]:
        rows = [c.seq for c in self.prefill] + self.decode
        return [rows[i] for i in self.sample_rows]

    def items(self) -> tuple[list[PrefillItem], list[DecodeItem]]:
        """The forward's inputs (`ModelRunner.step`)."""
        return ([PrefillItem(c.seq.seq_id, c.seq.tokens(c.start, c.start + c.length), c.start) for c in self.prefill],
                [_decode_row(s) for s in self.decode])


def _decode_row(seq: Sequence) -> DecodeItem:
    """A decode row: the position the step writes and the token there (`schedule()` counted it
    in `num_cached`; a kept seat's row, not counted, recomputes its last position)."""
    pos = seq.num_cached if seq.status is SeqStatus.FINISHED else seq.num_cached - 1
    return seq.seq_id, seq.token_at(pos), pos


class StepOutput(NamedTuple):
    """`seq` took `token`; `finish_reason` is "" while it goes on. (A named tuple: one per
    sequence a step.)"""

    seq: Sequence
    token: int
    finish_reason: str = ""


Judge = Callable[[Sequence, int], str]  # (sequence, its newest token) -> why it ends ("" = it goes on)


class EngineCore:
    """victim: which running sequence is preempted first when the blocks run out (default: the
    highest `priority`, then the newest; None: none may go); reserved_blocks: free blocks the
    core must leave alone (promised to sequences arriving); requeue_preempted: a preempted
    sequence goes back to the head of the waiting queue (else out, in `plan.preempted`);
    urgent_first: sequences wait in `priority` order, and a step's prompt chunks go only to the
    most urgent priority with a prompt to run (unless none of those can be admitted), so an
    urgent prompt's step is not made longer by others' chunks (a prefill worker: the
    scheduler's tier, then below/at fair share); alone: the core is the only user of its pool,
    so a sequence it cannot admit with nothing running never will be (it raises rather than
    hang; a worker sharing its pool with another core waits instead)."""

    def __init__(self, runner: ModelRunner, policy: BatchPolicy = BatchPolicy(),
                 strategy: Strategy = Strategy(), requeue_preempted: bool = True,
                 clock=time.monotonic, victim: Callable[[list[Sequence]], Sequence | None] | None = None,
                 reserved_blocks: Callable[[], int] = lambda: 0, urgent_first: bool = False, alone: bool = True):
        self.runner = runner
        self.policy = policy
        self.strategy = strategy
        self.requeue_preempted = requeue_preempted
        self.clock = clock
        self.pick_victim = victim or self.victim
        self.reserved_blocks = reserved_blocks
        self.urgent_first = urgent_first
        self.alone = alone
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Hashable, Sequence] = {}  # insertion order = admission order
        self.preemptions = 0
        self.padded = 0  # rows computed for seats kept by finished sequences (request-level batches)
        self._wanted = False  # the last admission wanted to admit someone

    # -- in ------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (prompt, and tokens an earlier attempt generated, in `output`)."""
        seq.status = SeqStatus.WAITING
        seq.num_cached = 0
        seq.waiting_since = self.clock()
        if self.urgent_first and self.waiting and self.waiting[-1].priority > seq.priority:
            at = next(i for i, s in enumerate(self.waiting) if s.priority > seq.priority)
            self.waiting.insert(at, seq)  # behind every sequence as urgent as it
        else:
            self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """Queue a sequence whose K/V for positions [0, `seq.num_cached`) is in the pool already
        under its `seq_id` (a KV hand-off received): it holds those blocks while it waits, and is
        admitted by the strategy with no prefill (its next row decodes)."""
        if not 0 < seq.num_cached < seq.num_tokens:
            raise ValueError(f"sequence {seq.seq_id!r}: {seq.num_cached} positions cached of {seq.num_tokens}")
        seq.status = SeqStatus.WAITING
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

    def detach(self, seq_id: Hashable) -> Sequence:
        """A running sequence leaves the core with its KV blocks, which the caller now owns
        (and frees): a prompt prefilled here and handed off to decode elsewhere."""
        seq = self.running.pop(seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "detached"
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def held(self) -> list[Sequence]:
        """Every sequence the core holds that has not finished (waiting, then running)."""
        return [*self.waiting, *(s for s in self.running.values() if s.status is not SeqStatus.FINISHED)]

    # -- schedule ------------------------------------------------------------------------------

    def schedule(self, budget: int | None = None) -> CorePlan:
        """The next step (see the module's docstring); `budget`: its tokens, if fewer than the
        policy's `max_batched_tokens`."""
        plan = CorePlan()
        self._wanted = False
        self.release_seats()
        self._make_room(plan)
        budget = self.policy.max_batched_tokens if budget is None else min(budget, self.policy.max_batched_tokens)
        urgent = self._urgent() if self.urgent_first else None
        admitted = self._admit(budget, urgent) if not plan.preempted else []  # as vLLM: none joins a step that preempted
        if urgent is not None and not admitted and not any(
                s.priority == urgent and s.num_tokens - s.num_cached > 1 for s in self.running.values()):
            admitted = self._admit(budget, skip=urgent) if not plan.preempted else []  # none of them can run: the others go on
            urgent = None
        new = {id(s) for s in admitted if s.num_tokens - s.num_cached > 1}  # prompts to prefill
        out = new | {id(s) for s in plan.held_back}
        max_seq_len = self.runner.max_seq_len
        views = []
        for s in self.running.values():
            pending = s.num_tokens - s.num_cached
            if id(s) in out or (s.status is SeqStatus.FINISHED and s.num_tokens >= max_seq_len):
                continue
            if urgent is not None and pending > 1 and s.priority != urgent:
                continue  # a prompt less urgent than this step's waits, keeping its chunks
            views.append(s.view())
        step = self.policy.schedule(views, [], self.runner.free_blocks, budget)
        budget -= step.num_tokens
        chunks = list(step.prefill)
        for seq in admitted:  # prompts admitted this step: their first chunk in the budget left
            if id(seq) not in new:
                continue
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
            if seq.status is SeqStatus.RUNNING:  # a kept seat's row recomputes its last position
                seq.num_cached += 1
        plan.sample_rows += range(len(plan.prefill), len(plan.prefill) + len(plan.decode))
        if not plan and self.waiting and not self.running and self._wanted and self.alone:
            raise RuntimeError("cannot schedule any waiting sequence (no KV blocks or seat)")
        return plan

    def _urgent(self) -> tuple | None:
        """The most urgent priority of the sequences with a prompt to run (waiting, or running
        partway through their prompt); None when there is none."""
        prompts = [s.priority for s in self.waiting]
        prompts += [s.priority for s in self.running.values() if s.num_tokens - s.num_cached > 1]
        return min(prompts, default=None)

    def wait_hint_s(self) -> float:
        """With nothing to run, how long until `schedule()` may admit with no arrival (a
        request-level strategy's window)."""
        if self.running or not self.waiting:
            return 0.0
        return self.strategy.wait_hint_ms((self.clock() - self.waiting[0].waiting_since) * 1000) / 1000

    def victim(self, running: list[Sequence]) -> Sequence:
        """The default victim rule: of `running` (admission order), the least important
        `priority`, then the newest."""
        return max(enumerate(running), key=lambda p: (p[1].priority, p[0]))[1]

    def _make_room(self, plan: CorePlan) -> None:
        """Blocks for every decoding sequence's next token, taken from the free blocks not
        reserved; while they are not free, the victim is preempted by recompute (which may be
        that sequence itself). A seat kept for a finished sequence takes a block only if one is
        free (else its padding row is left out)."""
        if not self.running:
            return
        bs = self.runner.block_size
        for seq in list(self.running.values()):
            n = seq.num_tokens
            if n - seq.num_cached != 1 or (n - 1) % bs:  # not decoding, or its next position is in a block it holds
                continue
            if self.running.get(seq.seq_id) is not seq:
                continue
            padding = seq.status is SeqStatus.FINISHED
            while self.running.get(seq.seq_id) is seq and not self._grow(seq):
                victim = None if padding else self.pick_victim(
                    [s for s in self.running.values() if s.status is SeqStatus.RUNNING])
                if victim is None:  # nothing may go: its row waits (a padding row, or no victim allowed)
                    plan.held_back.append(seq)
                    break
                self._preempt(victim, plan)

    def _grow(self, seq: Sequence) -> bool:
        """Takes the blocks `seq` needs for its next token from the free blocks not reserved.
        -> False (taking nothing) when they are not there."""
        runner = self.runner
        missing = runner.missing_blocks(seq.seq_id, seq.num_tokens)
        if not missing:  # most steps: its last block has room (the reserve is not even asked)
            return True
        if missing > runner.free_blocks - self.reserved_blocks():
            return False
        runner.ensure(seq.seq_id, seq.num_tokens)
        return True

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

    def _admit(self, budget: int, urgent: tuple | None = None, skip: tuple | None = None) -> list[Sequence]:
        """Waiting sequences given KV blocks this step (in order), as the strategy, the seats
        (`max_num_seqs`), the step's token `budget` and the free blocks allow (only those of
        priority `urgent`, or all but those of priority `skip`, if given). With the prefix
        cache on, a prompt whose leading full blocks a prompt being computed will hold, and the
        cache does not yet, waits a step (`waits_for_shared_prefix`) to share them instead of
        computing them twice."""
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
        if urgent is not None or skip is not None:
            candidates = [s for s in candidates if (s.priority == urgent if urgent is not None else s.priority != skip)]
        budget -= sum(1 for s in self.running.values() if s.num_tokens - s.num_cached == 1)
        computing = [s.tokens(0, s.num_tokens) for s in self.running.values()
                     if s.num_tokens - s.num_cached > 1] if runner.prefix_cache else []
        admitted = []
        for seq in candidates:
            if budget <= 0 and not strategy.run_to_completion:  # a request-level batch starts whole
                break
            if seq.num_cached:  # its K/V arrived with it (add_prefilled): a block for its next token
                if not self._grow(seq):
                    self._wanted = False  # it waits for blocks that others hold; it is not stuck
                    break
            else:
                tokens = seq.tokens(0, seq.num_tokens)
                if computing and waits_for_shared_prefix(tokens, lambda: runner.cached_tokens(tokens), computing,
                                                         runner.block_size):
                    continue
                try:
                    seq.num_cached = runner.allocate(seq.seq_id, tokens, seq.reserve_tokens)
                except KVPoolFull:  # no blocks: it waits (in order: the ones behind it wait too)
                    break
                if runner.prefix_cache and seq.num_cached < seq.num_tokens:
                    computing.append(tokens)
            budget -= min(seq.num_tokens - seq.num_cached, policy.prefill_chunk)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running[seq.seq_id] = seq
            admitted.append(seq)
        return admitted

    # -- update --------------------------------------------------------------------------------

    def update(self, plan: CorePlan, tokens: list[int], judge: Judge | None = None) -> list[StepOutput]:
        """`tokens[i]`: the token sampled for `plan.sample[i]`. -> what each of them took; those
        that finished have left (blocks freed, status FINISHED), or keep their seat until their
        request-level batch ends. `judge(seq, token)`, called once the token is appended, says
        whether it ends (default: `end_reason`'s token-level rules)."""
        outputs = []
        max_seq_len = self.runner.max_seq_len
        keep_seats = self.strategy.run_to_completion
        for seq, token in zip(plan.sample, tokens):
            if self.running.get(seq.seq_id) is not seq:  # ended meanwhile (finish())
                continue
            if seq.status is SeqStatus.FINISHED:  # a seat kept: its token is thrown away
                self.padded += 1
                continue
            seq.output.append(token)
            if judge is not None:
                reason = judge(seq, token)
            else:
                reason = end_reason(seq.params, token, seq.eos_token_ids, len(seq.output), seq.num_tokens - 1,
                                    max_seq_len)
            if reason:
                if keep_seats:
                    seq.status = SeqStatus.FINISHED
                    seq.finish_reason = reason
                else:
                    del self.running[seq.seq_id]
                    self._end(seq, reason)
            outputs.append(StepOutput(seq, token, reason))
        return outputs

    def release_seats(self) -> list[Sequence]:
        """Once every running sequence of a request-level batch has finished, their seats are
        given up (their blocks freed; `schedule()` does it too). -> the sequences that left."""
        if (not self.strategy.run_to_completion or not self.running
                or any(s.status is not SeqStatus.FINISHED for s in self.running.values())):
            return []
        done = list(self.running.values())
        for seq in done:
            del self.running[seq.seq_id]
            self.runner.free(seq.seq_id)
        return done

    def _end(self, seq: Sequence, reason: str) -> None:
        self.runner.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
