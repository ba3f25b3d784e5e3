"""Batch forming: how many requests, taken in the order of choice, go into one prefill batch;
and which decode worker takes each."""

from collections.abc import Iterable
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


@dataclass
class DecodeSlots:
    """What the scheduler believes about one decode worker's free sequence slots."""

    worker_id: str
    address: str
    free_slots: int


def choose_decode_worker(workers: list[DecodeSlots], local: str = "") -> DecodeSlots | None:
    """The worker at address `local` (the prefill worker's own: a colocated worker keeps the
    K/V where it is, no transfer) while it has a free slot, else the one with the most free
    slots (ties: by id, so the choice is stable)."""
    open_ = [w for w in workers if w.free_slots > 0]
    if not open_:
        return None
    here = [w for w in open_ if local and w.address == local]
    return max(here or open_, key=lambda w: (w.free_slots, w.worker_id))
