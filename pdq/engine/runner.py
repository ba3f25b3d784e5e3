"""ModelRunner: the model plus its KV pool; runs one forward per step for many sequences.

Sequences are addressed by id. The caller owns admission: `allocate(seq_id)` before the
first prefill (raises KVPoolFull when there is no room), `free(seq_id)` when done. The runner
tracks how many positions of each sequence hold K/V (`kv_length`).
"""

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pdq.engine import kv_order
from pdq.engine.attention import AttnMetadata, PrefillChunk, additive_mask
from pdq.engine.kv_pool import KVPool, KVUsage
from pdq.engine.llama import LlamaModel
from pdq.model.arch import ModelSpec


@dataclass(frozen=True)
class PrefillItem:
    """A chunk of one sequence's tokens at positions [start_pos, start_pos + len(token_ids)).

    start_pos = tokens already in that sequence's KV (0 for its first chunk).
    """

    seq_id: Hashable
    token_ids: Sequence[int]
    start_pos: int = 0


DecodeItem = tuple[Hashable, int, int]
"""(seq_id, token_id, position): feed `token_id` at `position` (= the sequence's KV length)."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device, checkpoint_dtype: torch.dtype | str | None) -> torch.dtype:
    """float32 on CPU; on GPU the checkpoint's 16-bit dtype, else bfloat16 (or float16)."""
    if device.type == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class ModelRunner:
    """Owns the model weights and the KV pool on one device.

    `model`: an HF `LlamaForCausalLM` (or anything with `.config` and `.state_dict()` of
    that layout). Weights are converted to `dtype` on `device`; the HF model may be dropped.
    """

    def __init__(
        self,
        model,
        *,
        kv_budget_tokens: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        config = model.config
        spec = ModelSpec.from_hf_config(config)
        spec.check_max_seq_len(max_seq_len)
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype or default_dtype(self.device, getattr(config, "dtype", None))
        state = {
            name: t.detach().to(device=self.device, dtype=self.dtype if t.is_floating_point() else t.dtype)
            for name, t in model.state_dict().items()
        }
        self.model = LlamaModel.from_hf(state, config, max_seq_len).to(self.device).prepack()
        self.spec = spec
        self.pool = KVPool(
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            kv_budget_tokens=kv_budget_tokens,
            max_seq_len=max_seq_len,
            dtype=self.dtype,
            device=self.device,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        kv_budget_tokens: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> "ModelRunner":
        """Load a local HF checkpoint directory (`pdq.model.arch` lists the families). The config is
        checked before the weights load."""
        from transformers import AutoConfig, AutoModelForCausalLM

        ModelSpec.from_hf_config(AutoConfig.from_pretrained(path)).check_max_seq_len(max_seq_len)  # before the weights
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        return cls(hf, kv_budget_tokens=kv_budget_tokens, max_seq_len=max_seq_len, device=device, dtype=dtype)

    # -- model facts -------------------------------------------------------------------------

    num_layers = property(lambda self: self.spec.num_layers)
    num_kv_heads = property(lambda self: self.spec.num_kv_heads)
    head_dim = property(lambda self: self.spec.head_dim)
    vocab_size = property(lambda self: self.spec.vocab_size)
    eos_token_ids = property(lambda self: self.spec.eos_token_ids)
    max_seq_len = property(lambda self: self.pool.max_seq_len)

    # -- KV slots ----------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable) -> None:
        """Reserve a KV slot for `seq_id` (KV length 0). Raises KVPoolFull when none is free."""
        self.pool.allocate(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Release `seq_id`'s KV slot. Idempotent."""
        with torch.inference_mode():
            self.pool.free(seq_id)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """`old`'s slot (its K/V and length) now belongs to `new`. See `KVPool.rename`."""
        self.pool.rename(old, new)

    def can_allocate(self, n: int = 1) -> bool:
        return self.pool.can_allocate(n)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def usage(self) -> KVUsage:
        return self.pool.usage()

    def kv_length(self, seq_id: Hashable) -> int:
        """Positions [0, n) of `seq_id` hold K/V."""
        return self.pool.length(seq_id)

    def warm_up(self, step_tokens: int, chunk: int) -> None:
        """Runs full-size passes on scratch slots and frees them: a prefill pass of
        `step_tokens` tokens in chunks of at most `chunk`, then a decode step of those
        sequences, as vLLM's and TGI's start-up runs do. The first passes of that size in a
        process are otherwise slower (the allocator maps their buffers fresh), and would land
        on the first users' requests. A pool without room for a scratch slot is left as it is."""
        chunk = max(1, min(chunk, self.max_seq_len - 1))
        sizes, left = [], max(1, step_tokens)
        while left > 0 and len(sizes) < self.num_free:
            sizes.append(min(chunk, left))
            left -= sizes[-1]
        keys = [("warm-up", i) for i in range(len(sizes))]
        for key in keys:
            self.allocate(key)
        try:
            self.prefill([PrefillItem(key, [0] * n, 0) for key, n in zip(keys, sizes)])
            self.decode([(key, 0, n) for key, n in zip(keys, sizes)])
        finally:
            for key in keys:
                self.free(key)

    # -- forward -----------------------------------------------------------------------------

    def prefill(self, items: Sequence[PrefillItem]) -> torch.Tensor:
        """One forward over several sequences' chunks; float logits [len(items), vocab] of
        each chunk's last position. Writes the chunks' K/V into the pool."""
        return self.step(items, ())

    def decode(self, items: Sequence[DecodeItem]) -> torch.Tensor:
        """One forward, one new token per sequence; float logits [len(items), vocab]."""
        return self.step((), items)

    @torch.inference_mode()
    def step(self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem]) -> torch.Tensor:
        """Prefill chunks and decode tokens in one forward. Logits rows: prefill items in
        order, then decode items in order. Each sequence may appear at most once."""
        if not prefill and not decode:
            return torch.empty(0, self.vocab_size, device=self.device)
        if not prefill:
            self._sort_pool()
        input_ids, meta, logit_rows = self._prepare(prefill, decode)
        return self.model(input_ids, meta, self.pool.kv, logit_rows)

    def _prepare(self, prefill, decode) -> tuple[torch.Tensor, AttnMetadata, torch.Tensor | slice]:
        """Validate the items, flatten them into token rows (prefill chunks, then decode
        tokens), build the attention plan, and advance each sequence's KV length."""
        pool, dev = self.pool, self.device
        tokens: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        chunks: list[PrefillChunk] = []
        logit_rows: list[int] = []
        seen = set()
        for item in prefill:
            n, start = len(item.token_ids), item.start_pos
            slot = self._claim(item.seq_id, start, n, seen)
            if n == 0:
                raise ValueError(f"empty prefill chunk for sequence {item.seq_id!r}")
            mask = None
            if start:
                q_pos = torch.arange(start, start + n, device=dev)
                mask = additive_mask(torch.arange(start + n, device=dev)[None, :] <= q_pos[:, None], self.dtype)
            chunks.append(PrefillChunk(slot, start, n, len(tokens), mask))
            tokens.extend(item.token_ids)
            slots.extend([slot] * n)
            positions.extend(range(start, start + n))
            logit_rows.append(len(tokens) - 1)
        num_prefill = len(tokens)
        dec_slots = []
        for seq_id, token, pos in decode:
            dec_slots.append(self._claim(seq_id, pos, 1, seen))
            tokens.append(token)
            positions.append(pos)
        slots.extend(dec_slots)
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        logit_rows.extend(range(num_prefill, len(tokens)))
        slots_t, positions_t = torch.tensor(slots, device=dev), torch.tensor(positions, device=dev)
        heads = torch.arange(self.num_kv_heads, device=dev)
        kv_rows = ((slots_t[:, None] * self.num_kv_heads + heads) * self.max_seq_len + positions_t[:, None]).view(-1)
        meta = AttnMetadata(
            positions=positions_t,
            kv_rows=kv_rows,
            chunks=chunks,
            num_prefill_tokens=num_prefill,
            num_decode=len(decode),
        )
        if decode:
            self._plan_decode(meta, dec_slots, positions[num_prefill:])
        for item in prefill:
            pool.set_length(item.seq_id, item.start_pos + len(item.token_ids))
        for seq_id, _, pos in decode:
            pool.set_length(seq_id, pos + 1)
        rows = slice(None) if len(logit_rows) == len(tokens) else torch.tensor(logit_rows, device=dev)
        return torch.tensor(tokens, device=dev), meta, rows

    def _claim(self, seq_id, start: int, n: int, seen: set) -> int:
        """Check that positions [start, start + n) can be written for `seq_id`; return its slot."""
        if seq_id in seen:
            raise ValueError(f"sequence {seq_id!r} appears twice in one step")
        seen.add(seq_id)
        slot = self.pool.slot(seq_id)
        have = self.pool.length(seq_id)
        if not 0 <= start <= have:
            raise ValueError(f"sequence {seq_id!r}: position {start} but only {have} positions in KV")
        if start + n > self.max_seq_len:
            raise ValueError(f"sequence {seq_id!r}: {start + n} tokens exceed max_seq_len={self.max_seq_len}")
        return slot

    def _plan_decode(self, meta: AttnMetadata, dec_slots: list[int], dec_pos: list[int]) -> None:
        span = max(dec_slots) + 1
        length = max(dec_pos) + 1
        meta.decode_span, meta.decode_len = span, length
        if len(dec_slots) == span and self._plan_groups(meta, dec_slots, dec_pos):
            return
        dense = dec_slots == list(range(span))
        if not dense:
            meta.decode_slots = torch.tensor(dec_slots, device=self.device)
        if dense and min(dec_pos) == length - 1:
            return  # every query sees every key in [0, length): no mask
        pos_of_slot = [0] * span  # slots not decoding this step: attend to key 0 only (ignored)
        for s, p in zip(dec_slots, dec_pos):
            pos_of_slot[s] = p
        last = torch.tensor(pos_of_slot, device=self.device)
        keys = torch.arange(length, device=self.device)
        meta.decode_mask = additive_mask((keys[None, :] <= last[:, None]).view(span, 1, 1, length), self.dtype)

    def _plan_groups(self, meta: AttnMetadata, dec_slots: list[int], dec_pos: list[int]) -> bool:
        """Plans decode attention per slot group when that reads enough fewer keys (every slot
        of [0, span) decodes this step). -> whether it did."""
        span = len(dec_slots)
        pos_of_slot, row_of_slot = [0] * span, [0] * span
        for row, (slot, pos) in enumerate(zip(dec_slots, dec_pos)):
            pos_of_slot[slot], row_of_slot[slot] = pos, row
        lengths = [p + 1 for p in pos_of_slot]
        if not kv_order.worth_grouping(lengths):
            return False
        groups = []
        for first, end, keys in kv_order.groups(lengths):
            last = pos_of_slot[first:end]
            mask = None
            if min(last) != keys - 1:  # some sequence of the group sees fewer keys
                visible = torch.arange(keys, device=self.device)[None, :] <= torch.tensor(last, device=self.device)[:, None]
                mask = additive_mask(visible.view(end - first, 1, 1, keys), self.dtype)
            groups.append((first, end, keys, mask))
        meta.decode_groups = groups
        if row_of_slot != list(range(span)):
            meta.decode_order = torch.tensor(row_of_slot, device=self.device)
        return True

    def _sort_pool(self) -> None:
        """Moves the pool's sequences into length order (longest first) when the reads that
        saves pay for the copy (`kv_order.sort_order`), so grouped decode attention reads little
        past each sequence's own length."""
        order = kv_order.sort_order(self.pool.lengths())
        if order is not None:
            self.pool.reorder(order)

    # -- KV hand-off -------------------------------------------------------------------------

    @torch.inference_mode()
    def export_kv(self, seq_id: Hashable, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of `seq_id`'s K/V for positions [0, length) (default: all it has), one
        (k, v) per layer, each contiguous [num_kv_heads, length, head_dim] in `self.dtype`,
        rotary already applied to k. Safe to keep after `free`."""
        length = self.kv_length(seq_id) if length is None else length
        if length > self.kv_length(seq_id):
            raise ValueError(f"sequence {seq_id!r} has {self.kv_length(seq_id)} positions, asked {length}")
        return [
            tuple(t.clone(memory_format=torch.contiguous_format) for t in self.pool.view(seq_id, i, length))
            for i in range(self.num_layers)
        ]

    def kv_view(self, seq_id: Hashable, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable (k, v) views into the pool, [num_kv_heads, length, head_dim] each, for
        receiving a hand-off in place (e.g. `view.copy_(torch.frombuffer(...).view(...))`).
        Valid until the next `free`. After filling every layer, call `set_kv_length`."""
        return self.pool.view(seq_id, layer, length)

    @contextmanager
    def kv_slot(self, seq_id: Hashable) -> Iterator[torch.Tensor]:
        """`seq_id`'s K/V storage [num_layers, 2, num_kv_heads, max_seq_len, head_dim] with the
        pool locked, for receiving a hand-off from another thread while forward passes run (on
        sequences other than `seq_id`). See `KVPool.pinned` for the rules."""
        with self.pool.pinned(seq_id) as kv:  # the pool needs no grad: plain copy_ into it
            yield kv

    def set_kv_length(self, seq_id: Hashable, length: int) -> None:
        """Declare that positions [0, length) of `seq_id` hold K/V (after writing via kv_view)."""
        self.pool.set_length(seq_id, length)

    @torch.inference_mode()
    def import_kv(self, seq_id: Hashable, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy one layer's K/V [num_kv_heads, n, head_dim] (any device/dtype) into positions
        [0, n) of `seq_id`'s slot and set its KV length to n. Import every layer before use."""
        expected = (self.num_kv_heads, k.shape[1], self.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"import_kv: want k, v of shape {expected}, got {tuple(k.shape)}, {tuple(v.shape)}")
        dst_k, dst_v = self.pool.view(seq_id, layer, k.shape[1])
        dst_k.copy_(k)
        dst_v.copy_(v)
        self.pool.set_length(seq_id, k.shape[1])
