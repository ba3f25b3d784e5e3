"""LLMEngine: prefill and decode in one process, iteration-level continuous batching.

The same model runtime the service uses, without RPC or Redis: the reference the service is
benchmarked against. Every `step()` makes room for the running sequences' next tokens (preempting
the newest by recompute when the KV blocks run out), asks the `BatchPolicy` what to run, runs it
as one forward, samples, and lets finished sequences leave (freeing their blocks) at once.

Preemption by recompute: the preempted sequence's blocks are freed and it goes back to the head
of the waiting queue with its prompt plus the tokens generated so far; when readmitted it
prefills all of them (its own blocks, if still cached, are found again) and goes on sampling
where it stopped: no token twice, none missing.
"""

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pdq.engine.batch_policy import BatchPolicy, Chunk, SeqView
from pdq.engine.blocks import KVPoolFull
from pdq.engine.kv_pool import DEFAULT_BLOCK_SIZE
from pdq.engine.runner import ModelRunner, PrefillItem
from pdq.engine.sampling import SamplingParams, sample
from pdq.engine.sequence import Sequence


@dataclass(frozen=True)
class Completion:
    """A finished generation: output token ids (an EOS, if it ended one, is the last token)."""

    seq_id: int
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"


class LLMEngine:
    """In-process engine over a `ModelRunner`.

    max_batched_tokens: per-step token budget (decode tokens + prefill chunks);
    prefill_chunk: max prompt tokens of one sequence per step;
    max_num_seqs: max running sequences.
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batched_tokens: int = 1024,
        prefill_chunk: int = 512,
        max_num_seqs: int = 256,
    ):
        self.runner = runner
        self.policy = BatchPolicy(max_batched_tokens, prefill_chunk, max_num_seqs)
        self.preemptions = 0
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # insertion order = admission order (FCFS)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str, *, kv_budget_tokens: int, max_seq_len: int, device=None, dtype=None,
                        block_size: int = DEFAULT_BLOCK_SIZE, prefix_cache: bool = True, **kw):
        runner = ModelRunner.from_pretrained(
            path, kv_budget_tokens=kv_budget_tokens, max_seq_len=max_seq_len, device=device, dtype=dtype,
            block_size=block_size, prefix_cache=prefix_cache,
        )
        return cls(runner, **kw)

    def add_request(
        self, prompt: list[int], params: SamplingParams, eos_token_ids: Iterable[int] | int | None = None
    ) -> int:
        """Queue a prompt; returns its sequence id. eos_token_ids None = the model's EOS ids."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) + params.max_tokens > self.runner.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                f"max_seq_len={self.runner.max_seq_len}"
            )
        vocab = self.runner.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt has token ids outside [0, {vocab})")
        if eos_token_ids is None:
            eos_token_ids = self.runner.eos_token_ids
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        seq = Sequence(next(self._ids), prompt, params, frozenset(eos_token_ids))
        self.waiting.append(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_request(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence and free its KV blocks; False if unknown/finished."""
        seq = self.running.pop(seq_id, None)
        if seq is not None:
            self.runner.free(seq_id)
            return True
        for seq in self.waiting:
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                return True
        return False

    def _make_room(self) -> None:
        """Blocks for every running sequence's next decode token; while they are not free, the
        newest running sequence is preempted (its blocks freed, back to the head of `waiting`)."""
        runner = self.runner
        for seq in list(self.running.values()):
            if seq.seq_id not in self.running or seq.num_tokens - seq.num_cached != 1:
                continue
            while True:
                try:
                    runner.ensure(seq.seq_id, seq.num_tokens)
                    break
                except KVPoolFull:
                    victim = next(reversed(self.running.values()))
                    self._preempt(victim)
                    if victim is seq:
                        break

    def _preempt(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.runner.free(seq.seq_id)
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _waiting_views(self) -> list[SeqView]:
        """The waiting sequences the policy may admit this step (no more than the step's token
        budget can start), each with the prefix the cache holds for it and the blocks it needs."""
        runner, policy, views, budget = self.runner, self.policy, [], self.policy.max_batched_tokens
        for seq in itertools.islice(self.waiting, policy.max_num_seqs - len(self.running)):
            if budget <= 0:
                break
            cached = runner.cached_tokens(seq.tokens(0, seq.num_tokens))
            views.append(SeqView(seq.seq_id, seq.num_tokens, cached,
                                 runner.blocks_for(seq.num_tokens) - cached // runner.block_size))
            budget -= min(seq.num_tokens - cached, policy.prefill_chunk)
        return views

    def step(self) -> list[Completion]:
        """Run one iteration; returns the sequences that finished in it."""
        runner = self.runner
        self._make_room()
        views = self._waiting_views()
        plan = self.policy.schedule((s.view() for s in self.running.values()), views, runner.free_blocks)
        chunks = {c.seq_id: c for c in plan.prefill}
        for i, (seq_id, view) in enumerate(zip(plan.admit, views)):
            seq = self.waiting[0]
            assert seq.seq_id == seq_id == view.seq_id, "policy admits in waiting order"
            try:
                seq.num_cached = runner.allocate(seq_id, seq.tokens(0, seq.num_tokens))
            except KVPoolFull:  # a cached prefix counted on was evicted by an earlier admission: wait
                for later in plan.admit[i:]:
                    plan.prefill.remove(chunks[later])
                break
            self.waiting.popleft()
            self.running[seq_id] = seq
            if seq.num_cached != view.num_cached:
                c = chunks[seq_id]
                fixed = Chunk(seq_id, seq.num_cached, min(c.length, seq.num_tokens - seq.num_cached))
                plan.prefill[plan.prefill.index(c)] = fixed
        if not plan.prefill and not plan.decode:
            if self.waiting and not self.running:
                raise RuntimeError("cannot schedule any waiting sequence (no KV blocks or seat)")
            return []
        prefill, decode, to_sample = [], [], []
        for c in plan.prefill:
            seq = self.running[c.seq_id]
            prefill.append(PrefillItem(c.seq_id, seq.tokens(c.start, c.start + c.length), c.start))
            seq.num_cached = c.start + c.length
            to_sample.append(seq if seq.num_cached == seq.num_tokens else None)
        for seq_id in plan.decode:
            seq = self.running[seq_id]
            decode.append((seq_id, seq.token_at(seq.num_cached), seq.num_cached))
            seq.num_cached += 1
            to_sample.append(seq)
        logits = runner.step(prefill, decode)
        rows = [i for i, s in enumerate(to_sample) if s is not None]
        if not rows:  # only partial prompt chunks ran
            return []
        seqs = [to_sample[i] for i in rows]
        if len(rows) != len(to_sample):
            logits = logits[rows]
        tokens = sample(logits, [s.params for s in seqs], [len(s.output) for s in seqs],
                        [(s.prompt, s.output) for s in seqs], [s.eos_token_ids for s in seqs])
        done = []
        for seq, token in zip(seqs, tokens):
            if seq.append(token):
                del self.running[seq.seq_id]
                runner.free(seq.seq_id)
                done.append(Completion(seq.seq_id, seq.output, seq.finish_reason))
        return done

    def generate_completions(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        eos_token_ids: Iterable[int] | int | None = None,
    ) -> list[Completion]:
        """Run `prompts` to completion; results in prompt order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(p, sp, eos_token_ids) for p, sp in zip(prompts, params)]
        results = {}
        while self.has_unfinished():
            for c in self.step():
                results[c.seq_id] = c
        return [results[i] for i in ids]

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        eos_token_ids: Iterable[int] | int | None = None,
    ) -> list[list[int]]:
        """Output token ids per prompt, in prompt order."""
        return [c.token_ids for c in self.generate_completions(prompts, params, eos_token_ids)]
