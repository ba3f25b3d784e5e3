"""The dispatcher's prefix-aware placement (`scheduler.policies.prefix`) with its IO: the batch's
prompts, read from Redis, hashed with each worker's block size and matched against the prefixes
the worker reports and those this scheduler sent it lately. Prefill batches go where their
prompts' prefixes are cached (`place`); with separate decode workers, each request's decode
worker is chosen by the same knowledge (`decode_prefixes`, scored by
`scheduler.policies.batch.choose_decode_worker`), so its hand-off can leave out the prefix
that worker holds."""

from collections.abc import Iterable

from pdq.state.registry import PREFIX_HEX, WorkerInfo
from pdq.state.store import AsyncStore, now_ms
from scheduler.policies import (Candidate, DecodePrefix, PrefixRouting, SentPrefixes, chain_hashes, matched_tokens,
                                place_prefill)


class PrefixRouter:
    def __init__(self, store: AsyncStore, weight: float):
        self.store = store
        self.policy = PrefixRouting(weight)
        self.sent = SentPrefixes()
        self.sent_decode = SentPrefixes()  # what hand-offs carried to each separate decode worker lately
        self._hashes: dict[str, dict[int, list[str]]] = {}  # the latest round's batch: request -> block size -> hashes

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

    async def decode_prefixes(self, batch: list[Candidate], decode: list[WorkerInfo],
                              prefill_address: str) -> dict[str, DecodePrefix]:
        """Request id -> its prefix as `choose_decode_worker` scores it among the decode workers
        apart from the prefill worker at `prefill_address`: the chain hash of its first block,
        and the prompt tokens each one's cache holds (reported, or handed off to it lately).
        Empty (no Redis read) unless two or more such workers could take it."""
        now = now_ms()
        apart = [w for w in decode if w.address != prefill_address and w.kv_block_size > 0]
        self.sent_decode.forget(w.worker_id for w in decode)
        if len(apart) < 2:
            return {}
        sizes = {w.kv_block_size for w in apart}
        wanted = [c for c in batch if c.prompt_tokens > min(sizes)]
        self._hashes = {c.request_id: self._hashes.get(c.request_id, {}) for c in batch}  # this round's only
        missing = [c.request_id for c in wanted if not sizes <= set(self._hashes[c.request_id])]
        if missing:
            for rid, prompt in zip(missing, await self.store.prompts(missing)):
                self._hashes[rid].update({bs: chain_hashes(prompt, bs, PREFIX_HEX) for bs in sizes})
        held = {w.worker_id: set(w.prefixes) | self.sent_decode.held(w.worker_id, now) for w in apart}
        out = {}
        for c in wanted:
            hashes = self._hashes[c.request_id]
            if hashes[min(sizes)]:
                out[c.request_id] = DecodePrefix(hashes[min(sizes)][0], {
                    w.worker_id: matched_tokens(hashes[w.kv_block_size], w.kv_block_size, held[w.worker_id])
                    for w in apart})
        return out

    def hashes(self, request_id: str, block_size: int) -> list[str] | None:
        """The chain hashes of a request of the latest round at `block_size`, if hashed."""
        return self._hashes.get(request_id, {}).get(block_size)

    def handed_off(self, worker: WorkerInfo, request_id: str) -> None:
        """A request's K/V goes to the separate decode `worker`: its prompt's blocks will be
        there (a decode worker reports them once they arrive)."""
        hashes = self.hashes(request_id, worker.kv_block_size)
        if hashes:
            self.sent_decode.add(worker.worker_id, hashes, now_ms())

    def dispatched(self, worker: WorkerInfo, request_ids: Iterable[str]) -> None:
        """The requests of the latest batch placed went to `worker`: their prefixes will be there."""
        now = now_ms()
        for rid in request_ids:
            self.sent.add(worker.worker_id, self._hashes.get(rid, {}).get(worker.kv_block_size, ()), now)
