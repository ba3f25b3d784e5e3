"""Batch forming: how many requests, taken in the order of choice, go into one prefill batch;
which prefill worker takes a batch, and which decode worker takes each request.

A request whose attempt failed avoids the workers of its failed attempts (`Candidate.avoid`):
it goes to a worker it avoids only when every usable worker of that role is one it avoids. A
usable worker that is busy now (at its in-flight cap, no free slot) still counts: the request
waits for it rather than go back to a worker that failed it.
"""

from collections.abc import Collection, Iterable
from dataclasses import dataclass


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


def choose_decode_worker(workers: list[DecodeSlots], local: str = "",
                         avoid: Collection[str] = frozenset()) -> DecodeSlots | None:
    """Of the usable decode `workers` the request accepts (see `acceptable`), the one at address
    `local` (the prefill worker's own: a colocated worker keeps the K/V where it is, no
    transfer) while it has a free slot, else the one with the most free slots (ties: by id, so
    the choice is stable). None when none it accepts has a free slot."""
    if avoid:
        usable = [w.worker_id for w in workers]
        workers = [w for w in workers if acceptable(avoid, w.worker_id, usable)]
    open_ = [w for w in workers if w.free_slots > 0]
    if not open_:
        return None
    here = [w for w in open_ if local and w.address == local]
    return max(here or open_, key=lambda w: (w.free_slots, w.worker_id))
