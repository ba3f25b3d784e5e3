"""Paged KV bookkeeping: fixed-size blocks, a block table per sequence, automatic prefix caching.

Pure (no torch, no IO): which block holds which positions of which sequence. The KV pool
(`pdq.engine.kv_pool`) owns the storage; position p of a sequence lives in block
`table[p // block_size]` at offset `p % block_size`. A sequence holds the blocks its positions
use (plus any it reserved ahead), never a whole `max_seq_len`.

Prefix caching: a full block is named by a hash chain over the tokens of every block up to and
including it (`block_hashes`), so sequences whose first n * block_size tokens agree share those
n blocks, with reference counts. A block is named (`commit`) once its K/V is written. When its
last holder leaves, a named block stays cached: free to take, but found by the next prompt with
that prefix until its room is needed, least recently used first. A sequence only ever writes
positions past its shared prefix, into blocks of its own, so a shared block is never written.

Every live table is also a row of one int32 array (`TableRows`), kept as the tables change, so
that a step's decode tables reach the attention kernel as one array copy
(`BlockManager.table_rows`), not a conversion of every block number of every running sequence
(a cost that grows with their contexts).
"""

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


class KVPoolFull(RuntimeError):
    """Not enough free KV blocks: the caller waits for room, preempts, or refuses (never over-admits)."""


def block_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """The chain hashes of the full blocks of `tokens` from block index `start` on (`parent`: the
    hash of block start - 1, b"" for the first). Stable across processes and machines (blake2b of
    the token ids as little-endian int64)."""
    out = []
    for i in range(start * block_size, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *tokens[i:i + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class BlockStats:
    """Occupancy: blocks held by sequences, blocks free (of which cached: free but holding a named prefix)."""

    block_size: int
    num_blocks: int
    used: int
    cached: int
    seqs: int

    @property
    def free(self) -> int:
        return self.num_blocks - self.used


class TableRows:
    """The block tables of live sequences as rows of one int32 array: a sequence holds a row
    (`slot`) from its first blocks until it is freed; `write` copies a table's new tail in, and a
    row past a table's length holds block numbers of no meaning (earlier occupants', or 0), each
    a valid block. Rows and columns grow by doubling as needed (into a new array, filled before
    it replaces the old: a reader on another thread sees one or the other, each complete for the
    sequences it reads). Changes come under the KV pool's lock, as the tables'."""

    def __init__(self):
        self.rows = np.zeros((8, 8), dtype=np.int32)
        self.slot: dict[Hashable, int] = {}
        self._free: list[int] = []

    def write(self, seq_id: Hashable, table: list[int], start: int) -> None:
        """`table[start:]` into `seq_id`'s row (taking a row for a new sequence)."""
        slot = self.slot.get(seq_id)
        if slot is None:
            slot = self._free.pop() if self._free else len(self.slot)
            self.slot[seq_id] = slot
        n_rows, n_cols = self.rows.shape
        if slot >= n_rows or len(table) > n_cols:
            grown = np.zeros((n_rows if slot < n_rows else 2 * slot + 2,
                              n_cols if len(table) <= n_cols else 2 * len(table)), dtype=np.int32)
            grown[:n_rows, :n_cols] = self.rows
            self.rows = grown
        if len(table) > start:
            self.rows[slot, start:len(table)] = table[start:]

    def drop(self, seq_id: Hashable) -> None:
        slot = self.slot.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def rename(self, old: Hashable, new: Hashable) -> None:
        self.slot[new] = self.slot.pop(old)

    def take(self, seq_ids: Sequence[Hashable], width: int) -> np.ndarray:
        """The rows of `seq_ids`, first `width` columns: int32 [len(seq_ids), width], a copy."""
        rows = self.rows  # once: another thread's allocation may grow (replace) it meanwhile
        slots = [self.slot[s] for s in seq_ids]
        if width > rows.shape[1]:  # past every table's length: columns of no meaning
            out = np.zeros((len(slots), width), dtype=np.int32)
            out[:, :rows.shape[1]] = rows[slots]
            return out
        return rows[slots, :width]


class BlockManager:
    """Block tables and the free/cached lists of a pool of `num_blocks` blocks of `block_size` positions.

    `prefix_cache=False` names no block: every prompt is computed in full.
    Counters `queried_tokens` / `hit_tokens`: prompt tokens offered to the cache and found in it.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need >= 1 block of >= 1 position, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._free: deque[int] = deque(range(num_blocks))  # holding nothing anyone may look up
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but named, least recently used first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.tables: dict[Hashable, list[int]] = {}
        self.rows = TableRows()  # the same tables, as rows of an int32 array (`table_rows`)
        self._named: dict[Hashable, list[bytes]] = {}  # hashes of a sequence's leading named blocks
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be taken now (free, or cached and not held)."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _hits(self, tokens: Sequence[int]) -> list[int]:
        """Cached blocks holding a prefix of `tokens`, leaving at least its last token to compute."""
        if not self.prefix_cache or len(tokens) <= self.block_size:
            return []
        usable = tokens[:(len(tokens) - 1) // self.block_size * self.block_size]
        hits = []
        for h in block_hashes(usable, self.block_size):
            block = self._by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a sequence allocated now would find cached."""
        return len(self._hits(tokens)) * self.block_size

    def can_allocate(self, tokens: Sequence[int] | int, reserve_tokens: int = 0) -> bool:
        hits = [] if isinstance(tokens, int) else self._hits(tokens)
        n = tokens if isinstance(tokens, int) else len(tokens)
        taken_from_cache = sum(self._refs[b] == 0 for b in hits)
        return self.blocks_for(max(n, reserve_tokens)) - len(hits) <= self.num_free - taken_from_cache

    def cached_hashes(self, limit: int) -> list[bytes]:
        """The chain hashes of up to `limit` named blocks, the ones held by sequences first, then
        the cached ones, most recently used first: prefixes a prompt would find here now.
        Read-only, and safe to call from a thread other than the one changing the manager (the
        answer may be a moment old; [] if a change raced the read)."""
        try:
            named, cached = list(self._hash_of.items()), list(self._cached)
        except RuntimeError:  # changed during the copy
            return []
        free = set(cached)
        held = [h for b, h in named if b not in free]
        hash_of = dict(named)
        return (held + [hash_of[b] for b in reversed(cached) if b in hash_of])[:limit]

    def stats(self) -> BlockStats:
        return BlockStats(self.block_size, self.num_blocks, self.num_blocks - self.num_free, len(self._cached),
                          len(self.tables))

    # -- changes ------------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, tokens: Sequence[int], reserve_tokens: int = 0) -> int:
        """Gives `seq_id` a block table covering max(len(tokens), reserve_tokens) positions, its
        leading blocks shared from the cache where they hold a prefix of `tokens`. -> the number
        of leading positions whose K/V is already there (a multiple of block_size, < len(tokens)).
        Raises KVPoolFull (taking nothing) when the rest does not fit."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id!r} already has KV blocks")
        hits = self._hits(tokens)
        need = self.blocks_for(max(len(tokens), reserve_tokens)) - len(hits)
        if need > self.num_free - sum(self._refs[b] == 0 for b in hits):
            raise KVPoolFull(f"KV pool full: {need} blocks of {self.block_size} tokens needed, "
                             f"{self.num_free} free of {self.num_blocks}")
        for block in hits:
            self._hold(block)
        self.tables[seq_id] = table = hits + [self._take() for _ in range(need)]
        self.rows.write(seq_id, table, 0)
        self._named[seq_id] = [self._hash_of[b] for b in hits]
        if self.prefix_cache and len(tokens) > self.block_size:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def ensure(self, seq_id: Hashable, num_tokens: int) -> None:
        """Grows `seq_id`'s table to cover positions [0, num_tokens). Raises KVPoolFull (taking
        nothing) when the blocks are not free."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return
        if need > self.num_free:
            raise KVPoolFull(f"KV pool full: {need} more blocks needed, {self.num_free} free of {self.num_blocks}")
        have = len(table)
        table.extend(self._take() for _ in range(need))
        self.rows.write(seq_id, table, have)

    def table_rows(self, seq_ids: Sequence[Hashable], width: int) -> np.ndarray:
        """The block tables of `seq_ids` (each holding blocks) as int32 [len(seq_ids), width]:
        row i starts with table i; past its length, valid block numbers of no meaning (a reader
        masks or skips them)."""
        return self.rows.take(seq_ids, width)

    def named_blocks(self, seq_id: Hashable) -> int:
        """How many of `seq_id`'s leading blocks are named (committed); 0 for an unknown id."""
        named = self._named.get(seq_id)
        return len(named) if named is not None else 0

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Names the full blocks among `tokens` (the sequence's tokens whose K/V is now written),
        so later prompts with that prefix find them. A block whose content another block already
        names stays unnamed (it is freed as usual)."""
        if not self.prefix_cache:
            return
        named, table = self._named[seq_id], self.tables[seq_id]
        full = min(len(tokens) // self.block_size, len(table))
        if full <= len(named):
            return
        for i, h in enumerate(block_hashes(tokens[:full * self.block_size], self.block_size, len(named),
                                           named[-1] if named else b""), start=len(named)):
            named.append(h)
            block = table[i]
            if h not in self._by_hash and block not in self._hash_of:
                self._by_hash[h] = block
                self._hash_of[block] = h

    def free(self, seq_id: Hashable) -> None:
        """Releases `seq_id`'s blocks; named ones stay cached until their room is needed. Idempotent."""
        table = self.tables.pop(seq_id, None)
        self._named.pop(seq_id, None)
        self.rows.drop(seq_id)
        for block in reversed(table or ()):  # the tail first: a prefix outlives its continuations in the LRU
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def rename(self, old: Hashable, new: Hashable) -> None:
        if new in self.tables:
            raise ValueError(f"sequence {new!r} already has KV blocks")
        self.tables[new] = self.tables.pop(old)
        self._named[new] = self._named.pop(old)
        self.rows.rename(old, new)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._cached.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        """A block for new K/V: a never-named free one, else the least recently used cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block
