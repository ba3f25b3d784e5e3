"""Sampling parameters and the batched sampler.

Seeded sampling is a pure function of (logits row, params, token index): the random draw for
output token `step` of a request with seed `s` comes from a generator seeded with
`mix(s, step)`, so the token does not depend on the batch it ran in nor on which process
sampled it (prefill worker for token 0, decode worker for the rest, or a migrated sequence).
A seed is any uint64 (the proto's type): `mix` folds all 64 bits into the generator's range.

Nothing one row carries can fail or change another: a tiny temperature is a tiny temperature
(its limit is greedy, never NaN), and `sample_each` samples row by row after a batch raised, so
a row that cannot be sampled costs only its own request.
"""

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token.

    max_tokens: output tokens to generate at most (>= 1).
    temperature: 0 = greedy (argmax), else logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    seed: None = process RNG; an integer in [0, 2**64) makes the output reproducible anywhere.
    stop: stop strings, matched by the caller on detokenized text (the engine ignores them).
    ignore_eos: keep generating past EOS until max_tokens (for benchmarks).
    stop_token_ids: tokens that end the output as EOS does (ignore_eos does not skip them).
    min_p: keep tokens at least min_p times as likely as the top one (0 = off; sampled rows).
    presence_penalty, frequency_penalty: OpenAI's, over the output so far (0 = off).
    repetition_penalty: HF's, over the prompt and the output (1 = off).
    logit_bias: token id -> added to its logit (greedy rows too).
    logprobs: None, or the number of most likely tokens (0..20) whose log-probabilities come with
        each output token's own (`logprob_records`).
    json_schema, regex: structured output (`pdq.engine.constraint`; the workers apply it).
    min_tokens: output tokens before an EOS (unless ignore_eos), a stop token id or a stop string
        may end the output: until then their logits are -inf (`sample` needs the EOS ids) and the
        caller does not match stop strings.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    json_schema: str = ""
    regex: str = ""
    min_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MASK64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {sorted(self.stop_token_ids)!r}")
        for name, low, high in (("min_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                                ("repetition_penalty", 1e-6, 10)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {v!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not all(_is_int(t) and t >= 0 and isinstance(b, (int, float)) and math.isfinite(b) and -100 <= b <= 100
                   for t, b in self.logit_bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {self.logit_bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processed(self, step: int) -> bool:
        """Whether output token `step`'s logits change before the pick: penalties, a bias, or
        min_tokens not reached yet."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or step < self.min_tokens)

    def suppressed(self, step: int, eos_ids) -> list[int]:
        """The tokens output token `step` may not be: while min_tokens is not reached, every
        token that would end the output (its stop token ids, and EOS unless ignore_eos)."""
        if step >= self.min_tokens:
            return []
        return sorted(self.stop_token_ids | (frozenset() if self.ignore_eos else frozenset(eos_ids)))

    def finish(self, token: int, eos_ids) -> str:
        """Why the output ends with `token` ("eos" for an EOS or a stop token id), or "" (it
        goes on, unless its length ends it)."""
        if token in self.stop_token_ids or (token in eos_ids and not self.ignore_eos):
            return "eos"
        return ""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def token_seed(seed: int, step: int) -> int:
    """Generator seed for output token `step` of a request seeded `seed` (any uint64): a
    splitmix64 mix of seed and step, a bijection of the 64-bit state, kept to the 63 bits
    that torch's generators take."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


History = tuple[Sequence[int], Sequence[int]]
"""A row's (prompt tokens, output tokens so far): what its penalties look at."""


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
           histories: Sequence[History | None] | None = None,
           eos_ids: Sequence[Collection[int]] | None = None) -> list[int]:
    """Pick one token per row of `logits` [B, vocab].

    params[i] applies to row i; steps[i] is the index of the output token being sampled
    (0 for the first); histories[i] its tokens, needed for a row with penalties; eos_ids[i] its
    EOS tokens, what its min_tokens holds back (None: no row has min_tokens). Rows with
    penalties, a bias or min_tokens not reached have their logits changed first (`processed`),
    in a copy made only then. Greedy rows cost one
    batched argmax; the other rows are filtered (temperature, top-k, top-p, min-p) as one batch
    and drawn with the exponential-race trick (argmax of probs / Exp(1) noise), the noise of
    seeded rows from their own generator.
    """
    if len(params) != logits.shape[0] or len(steps) != logits.shape[0]:
        raise ValueError(f"sample: {logits.shape[0]} rows but {len(params)} params and {len(steps)} steps")
    if any(p.processed(step) for p, step in zip(params, steps)):
        logits = _process(logits, params, steps, histories, eos_ids)
    out = argmax_rows(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(logits, params, steps, rows)
        out[torch.tensor(rows, device=logits.device)] = picked
    return out.tolist()


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [B, V] tensor (the first index of each row's largest value, a NaN
    counting as the largest, as torch's). On CPU in float32/64 through numpy's argmax, which is
    vectorized: torch's CPU argmax walks each row element by element, 5-15x slower over a
    vocabulary (0.19 against 0.014 ms for 32 rows of 4,096; 5.5 against 1.2 ms at 128,256).
    16-bit rows are widened to float32 first (exact: the same order, ties and NaNs)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().contiguous().numpy().argmax(axis=1))
    return x.argmax(dim=-1)


def sample_each(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
                histories: Sequence[History | None] | None = None,
                eos_ids: Sequence[Collection[int]] | None = None) -> list[int | Exception]:
    """`sample`, except that a row whose sampling raises fails alone: after the batch raised, each
    row is sampled by itself (a seeded row draws the same token alone as in a batch), and a row
    that still raises gets its exception in place of a token."""
    try:
        return list(sample(logits, params, steps, histories, eos_ids))
    except Exception:
        out: list[int | Exception] = []
        for i in range(len(params)):
            try:
                out += sample(logits[i:i + 1], [params[i]], [steps[i]],
                              None if histories is None else [histories[i]],
                              None if eos_ids is None else [eos_ids[i]])
            except Exception as exc:
                out.append(exc)
        return out


def _sample_rows(logits, params, steps, rows: list[int]) -> torch.Tensor:
    dev = logits.device
    sub = [params[i] for i in rows]
    x = logits[rows].float()
    # the row's max goes first: x / 1e-38 overflows to inf, and softmax(inf - inf) is NaN; this way
    # the top token stays at 0 and the rest fall towards -inf (the limit is greedy). A temperature
    # below float32's smallest normal would round to 0 here: it is floored there.
    temperature = torch.tensor([p.temperature for p in sub], dtype=x.dtype, device=dev).clamp_min_(torch.finfo(x.dtype).tiny)
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]
    vocab = x.shape[-1]
    if any(p.top_k or p.top_p < 1 for p in sub):
        x = _filter_top_k_top_p(x, [min(p.top_k, vocab) or vocab for p in sub], [p.top_p for p in sub])
    probs = x.softmax(dim=-1)
    if any(p.min_p for p in sub):  # below min_p times the top token's probability: out
        floor = torch.tensor([p.min_p for p in sub], dtype=probs.dtype, device=dev)[:, None]
        probs = probs.masked_fill(probs < floor * probs.max(dim=-1, keepdim=True).values, 0.0)
    noise = torch.empty_like(probs).exponential_()
    for j, (i, p) in enumerate(zip(rows, sub)):
        if p.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(token_seed(p.seed, steps[i]))
            noise[j].exponential_(generator=gen)
    # a zero draw would make a filtered token 0/0 = NaN, and argmax picks NaN
    return argmax_rows(probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny))


def _filter_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. Keeps at least one token."""
    dev = x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=dev)[None, :]
    drop = rank >= torch.tensor(top_k, device=dev)[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop = mass_before >= torch.tensor(top_p, device=dev)[:, None]
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)


def _process(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
             histories: Sequence[History | None] | None,
             eos_ids: Sequence[Collection[int]] | None) -> torch.Tensor:
    """A copy of `logits` (float) with each processed row's penalties and bias applied, as vLLM
    applies them: repetition (HF's: a seen token's positive logit divided by it, a negative one
    multiplied), then presence and frequency over the output, then the bias; last, the tokens
    min_tokens holds back go to -inf."""
    x = logits.float().clone()
    vocab, dev = x.shape[-1], x.device
    for i, p in enumerate(params):
        if not p.processed(steps[i]):
            continue
        row = x[i]
        if p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty:
            if histories is None or histories[i] is None:
                raise ValueError("sample: a row with penalties needs its token history")
            prompt, output = histories[i]
            if p.repetition_penalty != 1:
                seen = torch.tensor(sorted({t for t in (*prompt, *output) if t < vocab}), dtype=torch.long, device=dev)
                if len(seen):
                    v = row[seen]
                    row[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and output:
                counts = torch.bincount(torch.tensor([t for t in output if t < vocab], dtype=torch.long, device=dev),
                                        minlength=vocab).to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long, device=dev)
            row[ids] += torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype, device=dev)
        held = [t for t in p.suppressed(steps[i], () if eos_ids is None else eos_ids[i]) if t < vocab]
        if held:
            row[torch.tensor(held, dtype=torch.long, device=dev)] = float("-inf")
    return x


def logprob_records(logits: torch.Tensor, tokens: Sequence[int | Exception],
                    params: Sequence[SamplingParams]) -> list[str]:
    """Per row: "" when its params ask for no logprobs (or its sampling failed: `tokens[i]` an
    Exception), else the record of its sampled token's log-probability and the top
    `params.logprobs` tokens' (`pdq.state.store.encode_logprobs`), from the model's distribution:
    log_softmax of the row's logits as the forward pass made them."""
    from pdq.state.store import encode_logprobs

    rows = [i for i, p in enumerate(params) if p.logprobs is not None and isinstance(tokens[i], int)]
    out = [""] * len(params)
    if not rows:
        return out
    lp = logits[rows].float().log_softmax(dim=-1)
    k = max(params[i].logprobs for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device)).squeeze(1).tolist()
    top_v = top_v.tolist() if k else None
    top_i = top_i.tolist() if k else None
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = encode_logprobs(chosen[j], list(zip(top_i[j][:n], top_v[j][:n])) if n else [])
    return out
