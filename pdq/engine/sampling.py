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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token.

    max_tokens: output tokens to generate at most (>= 1).
    temperature: 0 = greedy (argmax), else logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    seed: None = process RNG; an integer in [0, 2**64) makes the output reproducible anywhere.
    stop: stop strings, matched by the caller on detokenized text (the engine ignores them).
    ignore_eos: keep generating past EOS until max_tokens (for benchmarks).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """Pick one token per row of `logits` [B, vocab].

    params[i] applies to row i; steps[i] is the index of the output token being sampled
    (0 for the first). Greedy rows cost one batched argmax; the other rows are filtered
    (temperature, top-k, top-p) as one batch and drawn with the exponential-race trick
    (argmax of probs / Exp(1) noise), the noise of seeded rows from their own generator.
    """
    if len(params) != logits.shape[0] or len(steps) != logits.shape[0]:
        raise ValueError(f"sample: {logits.shape[0]} rows but {len(params)} params and {len(steps)} steps")
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        picked = _sample_rows(logits, params, steps, rows)
        out[torch.tensor(rows, device=logits.device)] = picked
    return out.tolist()


def sample_each(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
                ) -> list[int | Exception]:
    """`sample`, except that a row whose sampling raises fails alone: after the batch raised, each
    row is sampled by itself (a seeded row draws the same token alone as in a batch), and a row
    that still raises gets its exception in place of a token."""
    try:
        return list(sample(logits, params, steps))
    except Exception:
        out: list[int | Exception] = []
        for i in range(len(params)):
            try:
                out += sample(logits[i:i + 1], [params[i]], [steps[i]])
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
    noise = torch.empty_like(probs).exponential_()
    for j, (i, p) in enumerate(zip(rows, sub)):
        if p.seed is not None:
            gen = torch.Generator(device=dev).manual_seed(token_seed(p.seed, steps[i]))
            noise[j].exponential_(generator=gen)
    # a zero draw would make a filtered token 0/0 = NaN, and argmax picks NaN
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


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
