"""Batch forming: how many requests, taken in the order of choice, go into one prefill batch;
which prefill worker takes a batch, and which decode worker takes each request.

A request whose attempt failed avoids the workers of its failed attempts (`Candidate.avoid`):
it goes to a worker it avoids only when every usable worker of that role is one it avoids. A
usable worker that is busy now (at its in-flight cap, no free slot) still counts: the request
waits for it rather than go back to a worker that failed it.
"""

import zlib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """A queued request as the policies see it."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    tenant: str = ""
    tier: str = "interactive"
    deadline_ms: int = 0
    created_ms: int = 0
    avoid: frozenset[str] = frozenset()  # workers of its failed attempts

    @property
    def kv_tokens(self) -> int:
        """KV room the sequence may need at its longest; also its fair-share cost in tokens."""
        return self.prompt_tokens + self.max_tokens


def same_kv_dtype(a: str, b: str) -> bool:
    """Whether a worker whose model runs dtype `a` may hand a KV cache to one running `b` (a
    hand-off in another dtype is refused): the same, or either unknown ("")."""
    return not a or not b or a == b


def kv_matched(prefill: list, decode: list) -> list:
    """The prefill workers (anything with `kv_dtype`) that have a decode worker of their dtype."""
    return [p for p in prefill if any(same_kv_dtype(p.kv_dtype, d.kv_dtype) for d in decode)]


def form_batch(order: Iterable[Candidate], max_batch_size: int, max_batched_tokens: int) -> list[Candidate]:
    """Takes requests in the order of choice while the batch has room in count and prompt
    tokens; stops at the first that does not fit, so the order is never overtaken.

    A request larger than the whole token budget still goes alone (the prefill worker chunks
    it), so nothing can block the queue forever. Reads `order` lazily.
    """
    batch: list[Candidate] = []
    tokens = 0
    for cand in order:
        if batch and tokens + cand.prompt_tokens > max_batched_tokens:
            break
        batch.append(cand)
        tokens += cand.prompt_tokens
        if len(batch) >= max_batch_size:
            break
    return batch


def acceptable(avoid: Collection[str], worker_id: str, usable: Collection[str]) -> bool:
    """May a request that avoids `avoid` go to `worker_id`, of the `usable` workers of its role?
    Yes unless it avoids that worker while some usable worker is one it does not avoid."""
    return worker_id not in avoid or all(w in avoid for w in usable)


def place_prefill(batch: list[Candidate], loads: list[tuple[str, int]], cap: int) -> tuple[str | None, list[Candidate]]:
    """Which prefill worker takes a batch, and which of its requests go. `loads`: (worker id,
    prompt tokens in flight) of each usable prefill worker; one at `cap` or above takes nothing
    now. The target is the least loaded open worker (ties: by id) that the batch's first request
    able to go anywhere now accepts; the requests that accept it go, in order (the others stay
    queued for a worker they accept). -> (None, []) when no request can go now."""
    usable = [w for w, _ in loads]
    open_ = [w for w, n in sorted(loads, key=lambda x: (x[1], x[0])) if n < cap]
    for cand in batch:
        for w in open_:
            if acceptable(cand.avoid, w, usable):
                return w, [c for c in batch if acceptable(c.avoid, w, usable)]
    return None, []


@dataclass
class DecodeSlots:
    """What the scheduler believes about one decode worker's free sequence slots."""

    worker_id: str
    address: str
    free_slots: int


@dataclass(frozen=True)
class DecodePrefix:
    """What prefix routing knows of one request when choosing its separate decode worker."""

    key: str  # the chain hash of its prompt's first full block: names its prefix (rendezvous home)
    cached: Mapping[str, int] = field(default_factory=dict)  # decode worker id -> prompt tokens its cache holds


HOME_BONUS = 0.5  # a prefix's home worker's edge in `choose_decode_worker`'s score


def home_worker(key: str, workers: Iterable[DecodeSlots]) -> DecodeSlots:
    """The worker a prefix `key` lives on (rendezvous hashing: the highest hash of key and
    worker id): the same for every scheduler, and only the prefixes of a worker that comes or
    goes move."""
    return max(workers, key=lambda w: (zlib.crc32(f"{key}/{w.worker_id}".encode()), w.worker_id))


def choose_decode_worker(workers: list[DecodeSlots], local: str = "", avoid: Collection[str] = frozenset(),
                         prefix: DecodePrefix | None = None, prompt_tokens: int = 0) -> DecodeSlots | None:
    """Of the usable decode `workers` the request accepts (see `acceptable`), the one at address
    `local` (the prefill worker's own: a colocated worker keeps the K/V where it is, no
    transfer) while it has a free slot, else the best scored open one.

    Score (prefix-aware, when `prefix` names the request's prefix): the share of its
    `prompt_tokens` a worker's prefix cache holds, plus the worker's free slots over the most any
    open worker has (both in [0, 1]), plus HOME_BONUS on the prefix's `home_worker` among the
    open ones. A worker holding 90% of the prompt with a third of the best free slots (1.23)
    beats an empty one with all of them (1.0); and a prefix no worker holds yet, or several do,
    goes to its home unless another has over half the most free slots more, so each prefix
    gathers on one worker instead of filling every worker's cache. The prefix spares the
    hand-off its K/V (`handoff_skip`) and the worker's memory its blocks; the free slots keep
    decode batches even. Without a prefix: the most free slots. Ties: by id, so the choice is
    stable. None when none it accepts has a free slot."""
    if avoid:
        usable = [w.worker_id for w in workers]
        workers = [w for w in workers if acceptable(avoid, w.worker_id, usable)]
    open_ = [w for w in workers if w.free_slots > 0]
    if not open_:
        return None
    here = [w for w in open_ if local and w.address == local]
    if here:
        return max(here, key=lambda w: (w.free_slots, w.worker_id))
    if prefix is not None and prefix.key and prompt_tokens > 0 and len(open_) > 1:
        most = max(w.free_slots for w in open_)
        home = home_worker(prefix.key, open_)

        def score(w: DecodeSlots) -> float:
            return (min(1.0, prefix.cached.get(w.worker_id, 0) / prompt_tokens) + w.free_slots / most
                    + (HOME_BONUS if w is home else 0.0))
        return max(open_, key=lambda w: (score(w), w.free_slots, w.worker_id))
    return max(open_, key=lambda w: (w.free_slots, w.worker_id))


DecodeChooser = Callable[[list[DecodeSlots], str, Candidate], "DecodeSlots | None"]


def decode_chooser(prefixes: Mapping[str, DecodePrefix] | None = None) -> DecodeChooser:
    """`choose_decode_worker` as `place_round` calls it, once per candidate: with `prefixes`
    (request id -> what prefix routing knows of it), prefix-aware."""
    def choose(workers: list[DecodeSlots], local: str, cand: Candidate) -> DecodeSlots | None:
        return choose_decode_worker(workers, local, cand.avoid, (prefixes or {}).get(cand.request_id),
                                    cand.prompt_tokens)
    return choose
