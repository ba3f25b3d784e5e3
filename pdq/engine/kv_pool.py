"""The paged KV cache: preallocated storage in fixed-size blocks, addressed by sequence id.

Layout: one tensor `kv` [num_layers, 2 (k, v), num_blocks, num_kv_heads, block_size, head_dim];
the bookkeeping (block tables, sharing, the prefix cache) is `pdq.engine.blocks.BlockManager`.
A sequence holds the blocks its positions use, so the pool's token budget is shared by however
many sequences fit, not divided into `max_seq_len` slots. Blocks never move: a free is pure
bookkeeping, and any thread may hold a view of a sequence's blocks while it holds them.

Threads: every bookkeeping change happens under the pool's lock, so a KV hand-off may be received
(`allocate`, `write`, `rename`) on another thread while forward passes run; the forward reads only
the blocks of the sequences in its step, which nobody else writes.
"""

import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from pdq.engine.blocks import BlockManager, KVPoolFull  # noqa: F401  (KVPoolFull is part of this API)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class KVUsage:
    """Pool occupancy, in sequences, blocks and tokens. `tokens_cached` counts positions holding
    valid K/V of running sequences; `blocks_cached` free blocks still holding a reusable prefix."""

    seqs: int
    blocks_used: int
    blocks_total: int
    blocks_cached: int
    block_size: int
    tokens_cached: int

    @property
    def tokens_used(self) -> int:
        return self.blocks_used * self.block_size

    @property
    def tokens_capacity(self) -> int:
        return self.blocks_total * self.block_size

    @property
    def fraction(self) -> float:
        """Share of blocks in use, 0..1."""
        return self.blocks_used / self.blocks_total


class KVPool:
    """Blocks plus their storage. `kv_budget_tokens` is the memory budget in token positions
    (`kv_budget_tokens // block_size` blocks); no sequence may exceed `max_seq_len` positions."""

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
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_cache: bool = True,
    ):
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be > 0, got {max_seq_len}")
        if kv_budget_tokens < max_seq_len:
            raise ValueError(
                f"kv_budget_tokens={kv_budget_tokens} holds no sequence of max_seq_len={max_seq_len}"
            )
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.blocks = BlockManager(kv_budget_tokens // block_size, block_size, prefix_cache)
        # zeros, not empty: padded key positions must hold finite values (0 * NaN would poison softmax @ v)
        # one block more than the manager hands out: `scratch_block`, where padding rows of a
        # fixed-shape (CUDA graph) step write and read, so they never touch a sequence's K/V
        self.kv = torch.zeros(num_layers, 2, self.blocks.num_blocks + 1, num_kv_heads, block_size, head_dim,
                              dtype=dtype, device=device)
        self.scratch_block = self.blocks.num_blocks
        self._length: dict[Hashable, int] = {}
        self._tokens: dict[Hashable, list[int]] = {}  # the tokens of positions [0, n) where known, for `commit`
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def free_tokens(self) -> int:
        """Positions in blocks that can be taken now."""
        return self.blocks.num_free * self.block_size

    @property
    def num_seqs(self) -> int:
        return len(self._length)

    def can_allocate(self, tokens: Sequence[int] | int, reserve_tokens: int = 0) -> bool:
        """Whether a sequence of these prompt tokens (or this many), holding room for
        max(prompt, reserve_tokens) positions, fits now (cached prefix blocks count as found)."""
        with self._lock:
            return self.blocks.can_allocate(tokens, reserve_tokens)

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens of a prompt that the prefix cache holds now (a lookup: nothing is held)."""
        with self._lock:
            return self.blocks.cached_tokens(tokens)

    def allocate(self, seq_id: Hashable, tokens: Sequence[int] = (), reserve_tokens: int = 0) -> int:
        """Gives `seq_id` blocks for max(len(tokens), reserve_tokens) positions, sharing cached
        blocks that hold a prefix of `tokens`. -> positions whose K/V is already there (its
        length starts there). Raises KVPoolFull."""
        n = max(len(tokens), reserve_tokens)
        if n > self.max_seq_len:
            raise ValueError(f"{n} positions exceed max_seq_len={self.max_seq_len}")
        with self._lock:
            if seq_id in self._length:
                raise ValueError(f"sequence {seq_id!r} already has KV blocks")
            cached = self.blocks.allocate(seq_id, tokens, max(reserve_tokens, 1))
            self._length[seq_id] = cached
            self._tokens[seq_id] = list(tokens[:cached])
            return cached

    def ensure(self, seq_id: Hashable, num_tokens: int) -> None:
        """Blocks for positions [0, num_tokens) of `seq_id`. Raises KVPoolFull."""
        if num_tokens > self.max_seq_len:
            raise ValueError(f"sequence {seq_id!r}: {num_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        with self._lock:
            self.blocks.ensure(seq_id, num_tokens)

    def record(self, seq_id: Hashable, start: int, tokens: Sequence[int]) -> None:
        """The tokens whose K/V is being written at positions [start, start + len(tokens))."""
        known = self._tokens[seq_id]
        if len(known) >= start:
            del known[start:]
            known.extend(tokens)

    def commit(self, seq_id: Hashable) -> None:
        """Names the full blocks of `seq_id` whose K/V is written and whose tokens are known
        (`record`), so that later prompts with that prefix share them."""
        known = self._tokens.get(seq_id)
        if known is None or not self.blocks.prefix_cache:
            return
        n = min(len(known), self._length[seq_id])
        if n // self.block_size <= self.blocks.named_blocks(seq_id):  # most decode steps: no block filled since
            return
        with self._lock:
            self.blocks.commit(seq_id, known[:n] if n < len(known) else known)

    def free(self, seq_id: Hashable) -> None:
        """Releases `seq_id`'s blocks; unknown or already freed ids are ignored (idempotent)."""
        with self._lock:
            if self._length.pop(seq_id, None) is not None:
                self._tokens.pop(seq_id, None)
                self.blocks.free(seq_id)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """The blocks of `old` (K/V and length kept) now belong to `new`, which must have none."""
        with self._lock:
            if new in self._length:
                raise ValueError(f"sequence {new!r} already has KV blocks")
            self.length(old)
            self.blocks.rename(old, new)
            self._length[new] = self._length.pop(old)
            self._tokens[new] = self._tokens.pop(old)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._length

    def table(self, seq_id: Hashable) -> list[int]:
        """`seq_id`'s block table: position p lives in block table[p // block_size]."""
        self.length(seq_id)
        return self.blocks.tables[seq_id]

    def length(self, seq_id: Hashable) -> int:
        """Positions [0, length) of `seq_id` hold valid K/V. KeyError if it holds no blocks."""
        try:
            return self._length[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id!r} has no KV blocks") from None

    def set_length(self, seq_id: Hashable, length: int) -> None:
        """Record that positions [0, length) of `seq_id` now hold valid K/V."""
        have = len(self.table(seq_id)) * self.block_size
        if not 0 <= length <= have:
            raise ValueError(f"length {length} outside the {have} positions of {seq_id!r}'s blocks")
        self._length[seq_id] = length

    def read(self, seq_id: Hashable, length: int) -> torch.Tensor:
        """A copy of `seq_id`'s K/V for positions [0, length): [num_layers, 2, num_kv_heads, length, head_dim]."""
        blocks = self.table(seq_id)[: -(-length // self.block_size)]
        idx = torch.tensor(blocks, device=self.kv.device)
        kv = self.kv.index_select(2, idx)  # [L, 2, n, H, bs, D]
        layers, _, n, heads, bs, dim = kv.shape
        return kv.permute(0, 1, 3, 2, 4, 5).reshape(layers, 2, heads, n * bs, dim)[:, :, :, :length]

    def write(self, seq_id: Hashable, kv: torch.Tensor, start: int = 0, tokens: Sequence[int] | None = None) -> None:
        """Copies `kv` [num_layers, 2, num_kv_heads, n, head_dim] (any device or dtype) into
        positions [start, start + n) of `seq_id` (start a multiple of block_size) and sets its
        length to start + n. `tokens`: those positions' tokens, when known (for `commit`)."""
        if start % self.block_size:
            raise ValueError(f"write must start at a block boundary, got {start}")
        n = kv.shape[3]
        table = self.table(seq_id)
        first, count = start // self.block_size, -(-n // self.block_size)
        if first + count > len(table):
            raise ValueError(f"sequence {seq_id!r}: {start + n} positions exceed its blocks")
        layers, _, heads, _, dim = kv.shape
        padded = kv.new_zeros(layers, 2, heads, count * self.block_size, dim)
        padded[:, :, :, :n] = kv
        blocks = padded.view(layers, 2, heads, count, self.block_size, dim).permute(0, 1, 3, 2, 4, 5)
        idx = torch.tensor(table[first:first + count], device=self.kv.device)
        self.kv.index_copy_(2, idx, blocks.to(device=self.kv.device, dtype=self.kv.dtype))
        self._length[seq_id] = start + n
        if tokens is not None:
            self.record(seq_id, start, tokens)

    def usage(self) -> KVUsage:
        with self._lock:
            s = self.blocks.stats()
            return KVUsage(seqs=len(self._length), blocks_used=s.used, blocks_total=s.num_blocks,
                           blocks_cached=s.cached, block_size=s.block_size,
                           tokens_cached=sum(self._length.values()))
