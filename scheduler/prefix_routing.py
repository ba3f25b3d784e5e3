"""The dispatcher's prefix-aware placement of prefill batches (`scheduler.policies.prefix`) with
its IO: the batch's prompts, read from Redis, hashed with each worker's block size and matched
against the prefixes the worker reports and those this scheduler sent it lately."""

from collections.abc import Iterable

from pdq.state.registry import PREFIX_HEX, WorkerInfo
from pdq.state.store import AsyncStore, now_ms
from scheduler.policies import Candidate, PrefixRouting, SentPrefixes, chain_hashes, matched_tokens, place_prefill


class PrefixRouter:
    def __init__(self, store: AsyncStore, weight: float):
        self.store = store
        self.policy = PrefixRouting(weight)
        self.sent = SentPrefixes()
        self._hashes: dict[str, dict[int, list[str]]] = {}  # the latest batch placed: request -> block size -> hashes

    async def place(self, batch: list[Candidate], workers: list[WorkerInfo], decode: list[WorkerInfo],
                    loads: list[tuple[str, int]], cap: int) -> tuple[str | None, list[Candidate]]:
        """Which of the prefill `workers` takes the batch, and which of its requests go (as
        `place_prefill`; of equal choices, the one whose colocated `decode` worker has the fewer
        seats taken); one Redis round trip when there is a choice to make."""
        sizes = {w.kv_block_size for w in workers if w.kv_block_size > 0}
        if len(workers) < 2 or not sizes or all(c.prompt_tokens <= min(sizes) for c in batch):
            return place_prefill(batch, loads, cap)  # no choice, or no prompt with a full block to find
        prompts = await self.store.prompts([c.request_id for c in batch])
        now = now_ms()
        self.sent.forget(w.worker_id for w in workers)
        self._hashes = {c.request_id: {bs: chain_hashes(p, bs, PREFIX_HEX) for bs in sizes}
                        for c, p in zip(batch, prompts)}
        matched: dict[str, dict[str, int]] = {rid: {} for rid in self._hashes}
        for w in workers:
            if w.kv_block_size <= 0:
                continue
            held = set(w.prefixes) | self.sent.held(w.worker_id, now)
            for rid, hashes in self._hashes.items():
                matched[rid][w.worker_id] = matched_tokens(hashes[w.kv_block_size], w.kv_block_size, held)
        seats = {d.address: d.capacity - d.free_slots for d in decode}
        return self.policy.place(batch, loads, cap, matched, {w.worker_id: seats.get(w.address, 0) for w in workers})

    def dispatched(self, worker: WorkerInfo, request_ids: Iterable[str]) -> None:
        """The requests of the latest batch placed went to `worker`: their prefixes will be there."""
        now = now_ms()
        for rid in request_ids:
            self.sent.add(worker.worker_id, self._hashes.get(rid, {}).get(worker.kv_block_size, ()), now)
