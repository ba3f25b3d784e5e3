"""A preallocated KV cache pool of fixed-size slots, one slot per sequence.

Layout: one tensor `kv` [num_layers, 2 (k, v), num_slots, num_kv_heads, max_seq_len, head_dim].
A sequence owns one slot of `max_seq_len` positions for its whole life, so a running sequence
never needs more memory (no preemption) and a decode step writes one position in place (no
per-step cat or copy of the growing caches).

The pool keeps the live slots compact: sequences always occupy slots [0, num_used). Freeing a
slot moves the last live sequence's K/V into it, so batched decode attention can read the
view `kv[layer, :, :num_used]`. Slot numbers are therefore internal and may change on `free`;
callers address sequences by id only, and views into the pool are valid until the next `free`.

Threads: `free` and `reorder` move K/V between slots, so they must run on the thread that runs forward passes
(never during one). `allocate`, `rename` and writes under `pinned` may come from another thread
(a KV hand-off received in place): they never move a slot that a forward pass reads, and all
bookkeeping changes and slot moves happen under the pool's lock.
"""

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


class KVPoolFull(RuntimeError):
    """No free slot: the caller must wait for a sequence to finish (never over-admit)."""


@dataclass(frozen=True)
class KVUsage:
    """Pool occupancy. `tokens_cached` counts positions holding valid K/V."""

    seqs: int
    capacity: int
    tokens_cached: int
    tokens_capacity: int

    @property
    def fraction(self) -> float:
        """Share of slots in use, 0..1."""
        return self.seqs / self.capacity


class KVPool:
    """Slot allocator plus the K/V storage, addressed by sequence id.

    `kv_budget_tokens` is the memory budget in token positions; it gives
    `kv_budget_tokens // max_seq_len` slots (capacity in sequences).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        kv_budget_tokens: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        if kv_budget_tokens < max_seq_len:
            raise ValueError(
                f"kv_budget_tokens={kv_budget_tokens} holds no sequence of max_seq_len={max_seq_len}"
            )
        self.max_seq_len = max_seq_len
        self.capacity = kv_budget_tokens // max_seq_len
        # zeros, not empty: masked-out keys must hold finite values (0 * NaN would poison softmax @ v)
        self.kv = torch.zeros(
            num_layers, 2, self.capacity, num_kv_heads, max_seq_len, head_dim, dtype=dtype, device=device
        )
        self._slot: dict[Hashable, int] = {}
        self._owner: list[Hashable] = []  # _owner[slot] = seq_id, for slots [0, num_used)
        self._length: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def num_free(self) -> int:
        """Free slots (sequences that can still be admitted)."""
        return self.capacity - len(self._owner)

    def can_allocate(self, n: int = 1) -> bool:
        return self.num_free >= n

    def allocate(self, seq_id: Hashable) -> int:
        """Give `seq_id` a slot (its length starts at 0); returns the slot. Raises KVPoolFull."""
        with self._lock:
            if seq_id in self._slot:
                raise ValueError(f"sequence {seq_id!r} already has a KV slot")
            if not self.num_free:
                raise KVPoolFull(f"KV pool full: {self.capacity} sequences of {self.max_seq_len} tokens")
            slot = len(self._owner)
            self._owner.append(seq_id)
            self._slot[seq_id] = slot
            self._length[seq_id] = 0
            return slot

    def free(self, seq_id: Hashable) -> None:
        """Release `seq_id`'s slot; unknown or already freed ids are ignored (idempotent).
        Only on the forward-pass thread (it may move another sequence's K/V)."""
        with self._lock:
            slot = self._slot.pop(seq_id, None)
            if slot is None:
                return
            del self._length[seq_id]
            last = len(self._owner) - 1
            if slot != last:  # keep live slots compact: move the last sequence into the hole
                moved = self._owner[last]
                n = self._length[moved]
                if n:
                    self.kv[:, :, slot, :, :n] = self.kv[:, :, last, :, :n]
                self._owner[slot] = moved
                self._slot[moved] = slot
            self._owner.pop()

    def reorder(self, order: list[int]) -> None:
        """Moves the live sequences so that slot i holds the one that was in slot order[i] (a
        permutation of [0, num_used)); each keeps its K/V [0, length) and length. Only on the
        forward-pass thread, like `free`."""
        with self._lock:
            n = len(self._owner)
            if sorted(order) != list(range(n)):
                raise ValueError(f"reorder needs a permutation of the {n} live slots")
            saved = {src: self.kv[:, :, src, :, : self._length[self._owner[src]]].clone()
                     for dst, src in enumerate(order) if dst != src}
            for dst, src in enumerate(order):
                if src in saved:
                    self.kv[:, :, dst, :, : saved[src].shape[-2]] = saved[src]
            self._owner = [self._owner[src] for src in order]
            for slot, seq_id in enumerate(self._owner):
                self._slot[seq_id] = slot

    def lengths(self) -> list[int]:
        """K/V length of the sequence in each live slot, in slot order."""
        return [self._length[seq_id] for seq_id in self._owner]

    def rename(self, old: Hashable, new: Hashable) -> None:
        """The slot of `old` (K/V and length kept) now belongs to `new`, which must have none."""
        with self._lock:
            if new in self._slot:
                raise ValueError(f"sequence {new!r} already has a KV slot")
            slot = self.slot(old)
            del self._slot[old]
            self._slot[new], self._owner[slot] = slot, new
            self._length[new] = self._length.pop(old)

    @contextmanager
    def pinned(self, seq_id: Hashable) -> Iterator[torch.Tensor]:
        """Yields `seq_id`'s storage, a view [num_layers, 2 (k, v), num_kv_heads, max_seq_len,
        head_dim], with the pool locked: no allocate, free or slot move until the block ends.
        For writing K/V from another thread into a slot that no forward pass uses yet (the
        positions a move keeps are [0, length): set the length before writing)."""
        with self._lock:
            yield self.kv[:, :, self.slot(seq_id)]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot

    def slot(self, seq_id: Hashable) -> int:
        """Current slot of `seq_id` (changes when another sequence is freed). KeyError if none."""
        try:
            return self._slot[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no KV slot") from None

    def length(self, seq_id: Hashable) -> int:
        """Positions [0, length) of `seq_id` hold valid K/V."""
        self.slot(seq_id)
        return self._length[seq_id]

    def set_length(self, seq_id: Hashable, length: int) -> None:
        """Record that positions [0, length) of `seq_id` now hold valid K/V."""
        self.slot(seq_id)
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length {length} outside [0, {self.max_seq_len}]")
        self._length[seq_id] = length

    def view(self, seq_id: Hashable, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (k, v) views [num_kv_heads, length, head_dim] of positions [0, length).

        Views alias the pool: valid until the next `free` (which may move the sequence).
        """
        if not 0 <= length <= self.max_seq_len:
            raise ValueError(f"length {length} outside [0, {self.max_seq_len}]")
        slot = self.slot(seq_id)
        return self.kv[layer, 0, slot, :, :length], self.kv[layer, 1, slot, :, :length]

    def usage(self) -> KVUsage:
        with self._lock:
            return KVUsage(
                seqs=self.num_used,
                capacity=self.capacity,
                tokens_cached=sum(self._length.values()),
                tokens_capacity=self.capacity * self.max_seq_len,
            )
