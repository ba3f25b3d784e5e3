"""Pure batch forming: which queued requests go into the next prefill batch.

Takes plain data, returns decisions; no Redis, no gRPC. The queue order it receives is the
order of choice (FCFS by arrival here; tier and fair-share layers come on top of it).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    tenant: str = ""
    tier: str = "interactive"
    deadline_ms: int = 0

    @property
    def kv_tokens(self) -> int:
        """KV room the sequence may need at its longest."""
        return self.prompt_tokens + self.max_tokens


def form_batch(queue: list[Candidate], max_batch_size: int, max_batched_tokens: int) -> list[Candidate]:
    """Takes requests in queue order while the batch has room in count and prompt tokens.

    A request larger than the whole token budget still goes alone (the prefill worker chunks
    it), so nothing can block the queue forever.
    """
    batch: list[Candidate] = []
    tokens = 0
    for cand in queue:
        if len(batch) >= max_batch_size:
            break
        if batch and tokens + cand.prompt_tokens > max_batched_tokens:
            break
        batch.append(cand)
        tokens += cand.prompt_tokens
    return batch


@dataclass
class DecodeSlots:
    """What the scheduler believes about one decode worker's free sequence slots."""

    worker_id: str
    address: str
    free_slots: int


def choose_decode_worker(workers: list[DecodeSlots]) -> DecodeSlots | None:
    """The worker with the most free slots (ties: by id, so the choice is stable)."""
    open_ = [w for w in workers if w.free_slots > 0]
    if not open_:
        return None
    return max(open_, key=lambda w: (w.free_slots, w.worker_id))
