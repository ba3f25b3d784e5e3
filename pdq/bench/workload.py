"""Seeded benchmark workloads: the requests, with exact prompt and output lengths.

Prompts are token ids (sent as `prompt_token_ids`), drawn with a seeded RNG from the model's
vocabulary minus its special ids, so a prompt of n tokens is n tokens on every path (service,
engine, HF). Requests set `ignore_eos`, so a request's output is exactly `max_tokens` tokens.
The same (name, n, seed, vocabulary, max_model_len) always gives the same requests.
"""

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

WORKLOADS = ("mixed", "uniform", "long-prompt", "multi-tenant", "shared-prefix")
SHARED_PREFIX_TOKENS = 1000  # the shared-prefix workload's system prompt (less where max_model_len is short)
RESERVED_IDS = frozenset({0, 1, 2})  # never in a prompt: bos/eos/pad of the built-in model (and many others)
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    """A client population. `rate_share`: its relative share of the offered requests (so its
    arrival rate is rate * rate_share / sum of shares). `weight`: the fair-share weight the
    server is expected to give it; the report compares each tenant's share of tokens with it."""

    name: str
    weight: float = 1.0
    rate_share: float = 1.0


@dataclass(frozen=True)
class BenchRequest:
    """One request. `kind` groups requests for the report (e.g. "short" / "long")."""

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    tenant: str = DEFAULT_TENANT
    kind: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: tuple[BenchRequest, ...]
    tenants: tuple[Tenant, ...] = (Tenant(DEFAULT_TENANT),)

    @property
    def output_tokens(self) -> int:
        """Useful output tokens: what the requests ask for."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    def describe(self) -> str:
        p = [r.prompt_len for r in self.requests]
        o = [r.max_tokens for r in self.requests]
        return (f"{self.name}: {len(self.requests)} requests (seed {self.seed}), prompts {min(p)}..{max(p)} tokens "
                f"(sum {sum(p)}), outputs {min(o)}..{max(o)} tokens (sum {sum(o)})")


def vocabulary(model_dir: str | Path) -> list[int]:
    """Token ids a prompt may use: [0, vocab) of the tokenizer (and the model's embedding),
    minus ids 0..2 and every special token of the tokenizer and the config."""
    from pdq.model.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    size = min(tok.get_vocab_size(), int(config.get("vocab_size") or tok.get_vocab_size()))
    special = set(RESERVED_IDS)
    special |= {i for i, added in tok.get_added_tokens_decoder().items() if added.special}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(name)
        special |= set(value if isinstance(value, list) else [value] if value is not None else [])
    return [i for i in range(size) if i not in special]


REPEAT_STRIDE = 7919  # a prime: the k-th offer moves every id k * 7919 places along the vocabulary


def for_repeat(workload: Workload, vocab: Sequence[int], k: int) -> Workload:
    """`workload` as offered the k-th time in an invocation (0: itself): every prompt token id
    moved k * REPEAT_STRIDE places along `vocab`, a bijection, so the requests keep their lengths
    and whatever prefixes they share with each other, but no prefix cache filled by an earlier run
    holds them: every run does the same work."""
    if k == 0:
        return workload
    vocab = list(vocab)
    move = {t: vocab[(i + k * REPEAT_STRIDE) % len(vocab)] for i, t in enumerate(vocab)}
    return replace(workload, requests=tuple(replace(r, prompt_token_ids=tuple(move[t] for t in r.prompt_token_ids))
                                            for r in workload.requests))


def build(name: str, vocab: Sequence[int], *, n: int | None = None, seed: int = 0,
          max_model_len: int = 2048) -> Workload:
    """The workload `name` (one of WORKLOADS) with `n` requests (None = its default).
    Every request satisfies prompt + max_tokens <= max_model_len."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if not vocab:
        raise ValueError("empty vocabulary")
    if n is not None and n < 1:
        raise ValueError(f"the number of requests must be >= 1, got {n}")
    if max_model_len < 384:
        raise ValueError(f"max_model_len must be >= 384 for these workloads, got {max_model_len}")
    rng = random.Random(f"pdq-bench/{name}/{seed}")
    vocab = list(vocab)

    def request(i: int, prompt_len: int, max_tokens: int, tenant: str = DEFAULT_TENANT, kind: str = "") -> BenchRequest:
        max_tokens = min(max_tokens, max_model_len - prompt_len)
        ids = tuple(rng.choice(vocab) for _ in range(prompt_len))
        return BenchRequest(i, ids, max_tokens, tenant, kind)

    tenants = (Tenant(DEFAULT_TENANT),)
    if name == "mixed":
        reqs = [request(i, rng.randint(16, 256), rng.randint(8, 128)) for i in range(n or 32)]
    elif name == "uniform":
        reqs = [request(i, 128, 64) for i in range(n or 32)]
    elif name == "long-prompt":
        # ~1 in 8 requests has a ~2k-token prompt (just under max_model_len); the rest are short
        # and should not wait behind a whole long prefill (chunked prefill).
        n = n or 32
        long_at = set(rng.sample(range(n), max(1, n // 8)))
        reqs = [request(i, rng.randint(max_model_len - 248, max_model_len - 96), rng.randint(16, 64), kind="long")
                if i in long_at else request(i, rng.randint(16, 128), rng.randint(16, 128), kind="short")
                for i in range(n)]
    elif name == "shared-prefix":
        # chat-like: every request opens with the same long system prompt, then a short unique part
        system = tuple(rng.choice(vocab) for _ in range(min(SHARED_PREFIX_TOKENS, max_model_len - 256)))
        reqs = []
        for i in range(n or 32):
            own = request(i, rng.randint(16, 96), rng.randint(16, 64), kind="shared-prefix")
            reqs.append(BenchRequest(i, system + own.prompt_token_ids,
                                     min(own.max_tokens, max_model_len - len(system) - own.prompt_len), kind=own.kind))
    else:  # multi-tenant: one tenant floods at 4x the rate of the others; "premium" has twice the weight
        tenants = (Tenant("flood", weight=1.0, rate_share=4.0), Tenant("steady", weight=1.0, rate_share=1.0),
                   Tenant("premium", weight=2.0, rate_share=1.0))
        names = rng.choices([t.name for t in tenants], weights=[t.rate_share for t in tenants], k=n or 48)
        reqs = [request(i, rng.randint(16, 256), rng.randint(8, 128), tenant=t) for i, t in enumerate(names)]
    return Workload(name, seed, tuple(reqs), tenants)
