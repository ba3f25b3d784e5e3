"""LLMEngine: the engine core (`pdq.engine.core`) with a model and a sampler, in one process.

The same core, model runtime, KV pool and batching policies the service runs, without RPC or
Redis: the reference the service is benchmarked against. Every `step()` is the core's three
calls: `schedule()` (room for the running sequences' next tokens, preempting by recompute when
the KV blocks run out; admissions by the batching strategy; decode rows and prompt chunks under
the token budget), the forward, then `update()` with the sampled tokens; finished sequences
leave (their blocks freed) at once.

Preemption by recompute: the preempted sequence's blocks are freed and it goes back to the head
of the waiting queue with its prompt plus the tokens generated so far; when readmitted it
prefills all of them (its own blocks, if still cached, are found again) and goes on sampling
where it stopped: no token twice, none missing.
"""

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

from pdq.engine.batch_policy import BatchPolicy
from pdq.engine.batching import Strategy
from pdq.engine.core import EngineCore
from pdq.engine.kv_pool import DEFAULT_BLOCK_SIZE
from pdq.engine.runner import ModelRunner
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
    max_num_seqs: max running sequences;
    strategy: the batching strategy (`pdq.engine.batching`: continuous by default).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batched_tokens: int = 1024,
        prefill_chunk: int = 512,
        max_num_seqs: int = 256,
        strategy: Strategy = Strategy(),
    ):
        self.runner = runner
        self.policy = BatchPolicy(max_batched_tokens, prefill_chunk, max_num_seqs)
        self.core = EngineCore(runner, self.policy, strategy)
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str, *, kv_budget_tokens: int, max_seq_len: int, device=None, dtype=None,
                        block_size: int = DEFAULT_BLOCK_SIZE, prefix_cache: bool = True, **kw):
        runner = ModelRunner.from_pretrained(
            path, kv_budget_tokens=kv_budget_tokens, max_seq_len=max_seq_len, device=device, dtype=dtype,
            block_size=block_size, prefix_cache=prefix_cache,
        )
        return cls(runner, **kw)

    @property
    def waiting(self):
        return self.core.waiting

    @property
    def running(self) -> dict:
        return self.core.running

    @property
    def preemptions(self) -> int:
        return self.core.preemptions

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
        self.core.add(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def abort_request(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence and free its KV blocks; False if unknown/finished."""
        return self.core.finish(seq_id, "abort") is not None

    def step(self) -> list[Completion]:
        """Run one iteration; returns the sequences that finished in it. With nothing to run
        (a request-level strategy waiting out its window) it sleeps until it may admit."""
        plan = self.core.schedule()
        if not plan:
            time.sleep(min(self.core.wait_hint_s(), 0.05))
            return []
        logits = self.runner.step(*plan.items())
        if not plan.sample_rows:  # only partial prompt chunks ran
            return []
        seqs = plan.sample
        if len(plan.sample_rows) != logits.shape[0]:
            logits = logits[plan.sample_rows]
        tokens = sample(logits, [s.params for s in seqs], [len(s.output) for s in seqs],
                        [(s.prompt, s.output) for s in seqs], [s.eos_token_ids for s in seqs])
        return [Completion(o.seq.seq_id, o.seq.output, o.finish_reason)
                for o in self.core.update(plan, tokens) if o.finish_reason]

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
