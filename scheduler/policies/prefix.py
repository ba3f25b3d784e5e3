"""Prefix-aware placement: a prefill batch goes where its prompts' leading blocks are cached.

Each worker reports with its heartbeat the chain hashes of KV blocks its prefix cache names
(`pdq.engine.blocks.block_hashes`, as hex cut to `pdq.state.registry.PREFIX_HEX` digits; bounded,
most recently used first). A chain hash names the whole prefix up to its block, so a prompt,
hashed with the worker's block size, matches up to the deepest of its block hashes the worker
holds, even where the bounded report left a shallower one out.

The choice weighs what a worker would save against the work queued on it, both in prompt
tokens: score = weight * cached prefix tokens - prompt tokens in flight there (ties: the
worker with fewer sequences running, so new prefixes spread over the workers). The first
request of the batch that can go now picks the best-scoring open worker it accepts; the
batch's other requests go with it, but for those another open worker holds more of and scores
better for: they wait a round for theirs. With nothing cached anywhere and no sequences
running, this is load-only placement (`batch.place_prefill`).
"""

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.policies.batch import Candidate, acceptable


def chain_hashes(tokens: Sequence[int], block_size: int, digits: int) -> list[str]:
    """The short chain hashes of the full blocks of `tokens` that a prefix cache could serve,
    leaving the last token to compute (as `BlockManager` looks them up), as hex cut to `digits`:
    the digest of `pdq.engine.blocks.block_hashes` (blake2b of the token ids as little-endian
    int64), here without importing the engine."""
    out, parent = [], b""
    end = (len(tokens) - 1) // block_size * block_size
    for i in range(0, end, block_size):
        parent = hashlib.blake2b(parent + struct.pack(f"<{block_size}q", *tokens[i:i + block_size]),
                                 digest_size=16).digest()
        out.append(parent.hex()[:digits])
    return out


def matched_tokens(hashes: Sequence[str], block_size: int, held: Iterable[str]) -> int:
    """Leading tokens of a prompt (its `chain_hashes`) found among a worker's `held` hashes."""
    held = held if isinstance(held, (set, frozenset)) else set(held)
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] in held:
            return (i + 1) * block_size
    return 0


def handoff_skip(prompt: Sequence[int], block_size: int, held: Iterable[str], digits: int,
                 hashes: Sequence[str] | None = None) -> int:
    """Leading prompt positions a separate decode worker reporting `held` (its heartbeat's chain
    hashes, cut to `digits`) holds in its prefix cache: a hand-off to it may leave their K/V out
    (`KVHeader.skip_tokens`). 0 when it reports nothing. `hashes`: the prompt's `chain_hashes`
    at `block_size`, when the caller has them already. A short hash that only collides costs a
    PREFIX_MISSING refusal and a whole resend, never a wrong cache: the decode worker checks the
    full chain hashes."""
    if block_size <= 0 or not held:
        return 0
    if hashes is None:
        hashes = chain_hashes(prompt, block_size, digits)
    return matched_tokens(hashes, block_size, held)


@dataclass(frozen=True)
class PrefixRouting:
    weight: float = 4.0  # in-flight prompt tokens one cached prefix token outweighs (`SchedulerConfig.prefix_weight`)

    def place(self, batch: list[Candidate], loads: list[tuple[str, int]], cap: int,
              matched: dict[str, dict[str, int]], busy: dict[str, int] | None = None
              ) -> tuple[str | None, list[Candidate]]:
        """As `batch.place_prefill` (`loads`: (worker id, prompt tokens in flight); a worker at
        `cap` takes nothing now), scored by `matched`: request id -> worker id -> cached prefix
        tokens. Equal scores go to the less loaded, then the one with fewer `busy` sequences (a
        colocated worker's decode seats taken), then by id. -> (target worker, the requests that
        go there, in batch order); (None, []) when no request can go now."""
        load = dict(loads)
        usable = list(load)
        busy = busy or {}
        open_ = [w for w, n in sorted(loads, key=lambda x: (x[1], busy.get(x[0], 0), x[0])) if n < cap]

        def score(cand: Candidate, w: str) -> float:
            return self.weight * matched.get(cand.request_id, {}).get(w, 0) - load[w]

        def elsewhere(cand: Candidate, target: str) -> bool:
            """Does an open worker it accepts hold more of its prefix, and score better?"""
            mine = matched.get(cand.request_id, {})
            return any(mine.get(w, 0) > mine.get(target, 0) and score(cand, w) > score(cand, target)
                       for w in open_ if acceptable(cand.avoid, w, usable))

        for cand in batch:
            choices = [w for w in open_ if acceptable(cand.avoid, w, usable)]
            if choices:
                target = max(choices, key=lambda w: score(cand, w))  # ties: the first in `open_` order
                return target, [c for c in batch if acceptable(c.avoid, target, usable)
                                and (c is cand or not elsewhere(c, target))]
        return None, []


class SentPrefixes:
    """The prefixes this scheduler sent to each worker lately: a worker reports a prompt's
    blocks only once their prefill ran, so until then the requests that follow it with the same
    prefix are steered by what was sent. Bounded per worker (least recently sent out first);
    an entry lasts `ttl_ms` (by then the worker reports it, or has let it go)."""

    def __init__(self, ttl_ms: int = 30_000, per_worker: int = 4096):
        self.ttl_ms = ttl_ms
        self.per_worker = per_worker
        self._sent: dict[str, OrderedDict[str, int]] = {}

    def add(self, worker_id: str, hashes: Iterable[str], now_ms: int) -> None:
        sent = self._sent.setdefault(worker_id, OrderedDict())
        for h in hashes:
            sent[h] = now_ms
            sent.move_to_end(h)
        while len(sent) > self.per_worker:
            sent.popitem(last=False)

    def held(self, worker_id: str, now_ms: int) -> set[str]:
        sent = self._sent.get(worker_id)
        if not sent:
            return set()
        while sent and next(iter(sent.values())) < now_ms - self.ttl_ms:
            sent.popitem(last=False)
        return set(sent)

    def forget(self, live: Iterable[str]) -> None:
        """Drops the workers that are gone."""
        for w in set(self._sent) - set(live):
            del self._sent[w]
