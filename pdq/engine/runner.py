"""ModelRunner: the model plus its KV pool; runs one forward per step for many sequences.

Sequences are addressed by id. The caller owns admission: `allocate(seq_id, prompt)` before the
first prefill (raises KVPoolFull when its blocks are not free; it says how much of the prompt
the prefix cache already holds), `free(seq_id)` when done. The KV is paged (`pdq.engine.kv_pool`):
a sequence's blocks grow as it is written; the runner tracks how many positions of each
sequence hold K/V (`kv_length`).
"""

import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdq.config import DTYPE_NAMES
from pdq.engine import cpu_kernels
from pdq.engine.attention import AttnMetadata, PrefillChunk, additive_mask, decode_mask, kv_rows
from pdq.engine.cuda_graphs import DecodeGraphs
from pdq.engine.kv_pool import DEFAULT_BLOCK_SIZE, KVPool, KVUsage
from pdq.engine.llama import LlamaModel
from pdq.model.arch import ModelSpec
from pdq.model.checkpoint import load_checkpoint, resolved_config
from pdq.model.null import NullCheckpoint, null_step_ms
from pdq.model.null_forward import NullForward


@dataclass(frozen=True)
class PrefillItem:
    """A chunk of one sequence's tokens at positions [start_pos, start_pos + len(token_ids)).

    start_pos = tokens already in that sequence's KV (0 for its first chunk).
    """

    seq_id: Hashable
    token_ids: Sequence[int]
    start_pos: int = 0


@dataclass
class _StepRows:
    """One step flattened: every token row's id, position and pool row (block * block_size +
    offset); prefill chunks as (start, length, first row, block table or None from position 0);
    each decode row's sequence (`decode_ids`)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    pool_rows: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    chunks: list[tuple] = field(default_factory=list)
    decode_ids: list = field(default_factory=list)
    num_prefill: int = 0


def _ints(values, device: torch.device, dtype=np.int64) -> torch.Tensor:
    """A list of ints (or of equal-length lists) as a tensor on `device`, through numpy:
    `torch.tensor` of a Python list is 4-7x slower (it inspects every element)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype)).to(device)


DecodeItem = tuple[Hashable, int, int]
"""(seq_id, token_id, position): feed `token_id` at `position` (= the sequence's KV length)."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def serving_dtype(device: torch.device, checkpoint_dtype: torch.dtype | str | None,
                  cpu_flags: frozenset[str] | None = None) -> torch.dtype:
    """What a worker runs when no dtype is given (`--dtype`): on a CPU with bfloat16 matrix
    instructions (`pdq.ops.cpu.BFLOAT16_UNITS`: AMX, Intel Xeon 4th generation and later;
    AVX512_BF16, AMD Zen 4 and later) bfloat16, whose GEMMs run on them (1.8-2.1x float32's tokens/s
    with AMX, ~1.5x with AVX512_BF16, BENCHMARKS.md); otherwise `default_dtype`. `cpu_flags`:
    /proc/cpuinfo's (read when None)."""
    if device.type == "cpu":
        from pdq.ops.cpu import cpu_flags as read_flags, serves_bfloat16

        if serves_bfloat16(read_flags() if cpu_flags is None else cpu_flags):
            return torch.bfloat16
    return default_dtype(device, checkpoint_dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (as --dtype, PDQ_DTYPE and the registry spell it)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str | None) -> torch.dtype | None:
    """"bfloat16" -> torch.bfloat16 (a name of DTYPE_NAMES, as `dtype_name` writes it); None -> None."""
    if not name:
        return None
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be {', '.join(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype | None:
    """A worker's model dtype: `name` (--dtype, PDQ_DTYPE; one of DTYPE_NAMES, else ValueError) as
    a torch dtype; without one, `serving_dtype` on CPU and None elsewhere (the runtime's default
    there: the checkpoint's 16-bit dtype or bfloat16 on a GPU)."""
    if name:
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype must be {', '.join(DTYPE_NAMES)}, got {name!r} (--dtype or PDQ_DTYPE)")
        return torch_dtype(name)
    return serving_dtype(device, None) if device.type == "cpu" else None


def default_dtype(device: torch.device, checkpoint_dtype: torch.dtype | str | None) -> torch.dtype:
    """float32 on CPU; on GPU the checkpoint's 16-bit dtype, else bfloat16 (or float16). The
    runtime's own default (a ModelRunner built without a dtype); workers use `serving_dtype`."""
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
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_cache: bool = True,
    ):
        config = model.config
        spec = ModelSpec.from_hf_config(config)
        spec.check_max_seq_len(max_seq_len)
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = dtype or default_dtype(self.device, getattr(config, "dtype", None))
        step_ms = null_step_ms(config)
        if step_ms is not None:  # pdq.model.null: the same steps and KV pool, no weights, no compute
            self.model = NullForward(spec.vocab_size, step_ms / 1000, self.device)
        else:
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
            block_size=block_size,
            prefix_cache=prefix_cache,
        )
        # decode attention through the CPU kernel where it runs (float32 or bfloat16 on CPU), else by gathering
        self.decode_kernel = (self.device.type == "cpu" and self.dtype in cpu_kernels.DTYPES
                              and cpu_kernels.available())
        # on a GPU, decode-only steps replay CUDA graphs (PDQ_CUDA_GRAPHS=0: always eager)
        self.graphs = None
        if (self.device.type == "cuda" and step_ms is None
                and os.environ.get("PDQ_CUDA_GRAPHS", "1") not in ("0", "false")):
            self.graphs = DecodeGraphs(self.model, self.pool.kv, num_kv_heads=spec.num_kv_heads,
                                       block_size=block_size, scratch_block=self.pool.scratch_block,
                                       max_width=self.blocks_for(max_seq_len))

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        kv_budget_tokens: int,
        max_seq_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **pool,
    ) -> "ModelRunner":
        """Load a local HF checkpoint directory (`pdq.model.arch` lists the families; a null
        model's dir, `pdq.model.null`, has no weights to load). The config is checked before the
        weights load; the weights come straight from safetensors where they can
        (`pdq.model.checkpoint`; PDQ_LOAD_VIA_TRANSFORMERS=1: always through transformers' model
        classes). `pool`: `block_size`, `prefix_cache`."""
        if NullCheckpoint.is_null_dir(path):
            return cls(NullCheckpoint(path), kv_budget_tokens=kv_budget_tokens, max_seq_len=max_seq_len,
                       device=device, dtype=dtype, **pool)
        config = resolved_config(path)
        ModelSpec.from_hf_config(config).check_max_seq_len(max_seq_len)  # before the weights
        model = load_checkpoint(path, config) if os.environ.get("PDQ_LOAD_VIA_TRANSFORMERS", "") in ("", "0") else None
        if model is None:  # weights not in safetensors, other names, or a rope that transformers computes
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        return cls(model, kv_budget_tokens=kv_budget_tokens, max_seq_len=max_seq_len, device=device, dtype=dtype, **pool)

    # -- model facts -------------------------------------------------------------------------

    num_layers = property(lambda self: self.spec.num_layers)
    num_kv_heads = property(lambda self: self.spec.num_kv_heads)
    head_dim = property(lambda self: self.spec.head_dim)
    vocab_size = property(lambda self: self.spec.vocab_size)
    eos_token_ids = property(lambda self: self.spec.eos_token_ids)
    max_seq_len = property(lambda self: self.pool.max_seq_len)

    # -- KV blocks ---------------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, tokens: Sequence[int] = (), reserve_tokens: int = 0) -> int:
        """Give `seq_id` KV blocks for max(len(tokens), reserve_tokens) positions, sharing cached
        blocks that hold a prefix of `tokens` (its prompt). -> positions already computed (its
        first prefill chunk starts there). Raises KVPoolFull when the blocks are not free."""
        return self.pool.allocate(seq_id, tokens, reserve_tokens)

    def free(self, seq_id: Hashable) -> None:
        """Release `seq_id`'s KV blocks. Idempotent."""
        self.pool.free(seq_id)

    def rename(self, old: Hashable, new: Hashable) -> None:
        """`old`'s blocks (its K/V and length) now belong to `new`. See `KVPool.rename`."""
        self.pool.rename(old, new)

    def can_allocate(self, tokens: Sequence[int] | int, reserve_tokens: int = 0) -> bool:
        return self.pool.can_allocate(tokens, reserve_tokens)

    def ensure(self, seq_id: Hashable, num_tokens: int) -> None:
        """KV blocks for positions [0, num_tokens) of `seq_id`. Raises KVPoolFull."""
        self.pool.ensure(seq_id, num_tokens)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def free_tokens(self) -> int:
        """KV positions in free blocks."""
        return self.pool.free_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    @property
    def free_blocks(self) -> int:
        return self.pool.blocks.num_free

    def blocks_for(self, tokens: int) -> int:
        return self.pool.blocks.blocks_for(tokens)

    def missing_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `seq_id` still needs for positions [0, num_tokens) (`ensure` takes them)."""
        return max(0, self.blocks_for(num_tokens) - len(self.pool.table(seq_id)))

    @property
    def prefix_cache(self) -> bool:
        """Whether full blocks are named and shared (automatic prefix caching)."""
        return self.pool.blocks.prefix_cache

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Leading tokens of a prompt that the prefix cache holds now (a lookup: nothing is held)."""
        return self.pool.cached_tokens(tokens)

    def usage(self) -> KVUsage:
        return self.pool.usage()

    def kv_length(self, seq_id: Hashable) -> int:
        """Positions [0, n) of `seq_id` hold K/V."""
        return self.pool.length(seq_id)

    def warm_up(self, step_tokens: int, chunk: int, decode_rows: int = 0) -> None:
        """Runs full-size passes on scratch sequences and frees them: a prefill pass of
        `step_tokens` tokens in chunks of at most `chunk`, then a decode step of those
        sequences, as vLLM's and TGI's start-up runs do. The first passes of that size in a
        process are otherwise slower (the allocator maps their buffers fresh), and would land
        on the first users' requests. Scratch tokens never enter the prefix cache. Then, on CPU,
        every projection at each row count 1..`decode_rows` (the decode batches to come) and, in
        bfloat16, at each count a pass of up to `step_tokens` rows runs at (`warm_gemms`)."""
        chunk = max(1, min(chunk, self.max_seq_len - 1))
        sizes, left, blocks = [], max(1, step_tokens), 0
        while left > 0 and blocks + self.blocks_for(min(chunk, left) + 1) <= self.free_blocks:
            sizes.append(min(chunk, left))
            blocks += self.blocks_for(sizes[-1] + 1)
            left -= sizes[-1]
        keys = [("warm-up", i) for i in range(len(sizes))]
        for key, n in zip(keys, sizes):
            self.allocate(key, reserve_tokens=n + 1)
        try:
            self.step([PrefillItem(key, [0] * n, 0) for key, n in zip(keys, sizes)], (), commit=False)
            self.step((), [(key, 0, n) for key, n in zip(keys, sizes)], commit=False)
        finally:
            for key in keys:
                self.free(key)
        if self.graphs is not None:  # a decode batch is at most a step's tokens
            self.graphs.capture_all(max(1, step_tokens))
        self.warm_gemms(decode_rows, step_tokens)

    @torch.inference_mode()
    def warm_gemms(self, rows: int, most: int = 0, cpu_flags: frozenset[str] | None = None) -> None:
        """On CPU, runs each distinct projection shape of the model (q/k/v, o, gate/up, down,
        the head) once at every row count 1..`rows`, and at each larger count up to `most` that
        a GEMM runs at (`layers.gemm_rows`: in bfloat16, the multiples of BUCKET_ROWS). oneDNN
        builds its GEMM for each new row count the first time it sees one (measured on a Xeon
        with AMX: 1.3-1.9 ms at 50 rows in bfloat16, 0.4 ms in float32, against 0.15 ms for the
        product itself), and keeps it in a cache after: without this, a worker's first decode
        steps at each batch size and first prompt passes pay it while users wait. A decode
        step's rows are its sequences, so 1..max_batch_size covers every decode step.

        Not bfloat16 projections that torch's own GEMM runs (not prepacked for oneDNN: it needs
        AVX-512 or AVX-NE-CONVERT) on a CPU without bfloat16 matrix instructions (`cpu_flags`,
        read when None; `pdq.ops.cpu.serves_bfloat16`): there bfloat16 is emulated, nothing is
        built per row count and a first GEMM costs what every later one does (measured on an
        AVX2 EPYC: 209 against 206 ms for rows 1..64 of a 1536x512 projection; float32 77
        against 53), so the warm-up would only add its full price to the start (7.3 of the
        built-in model's 10.6 s there)."""
        if self.device.type != "cpu" or not hasattr(self.model, "modules"):
            return
        from pdq.engine.layers import Linear, gemm_rows
        from pdq.ops.cpu import cpu_flags as read_flags, serves_bfloat16

        shapes = {}
        for m in self.model.modules():
            if isinstance(m, Linear):
                shapes.setdefault((tuple(m.weight.shape), m.bias is not None), m)
        emulated = [k for k, m in shapes.items() if m.weight.dtype == torch.bfloat16 and m.packed is None]
        if emulated and not serves_bfloat16(read_flags() if cpu_flags is None else cpu_flags):
            for k in emulated:
                del shapes[k]
        for linear in shapes.values():
            counts = set(range(1, rows + 1))
            if linear.weight.dtype == torch.bfloat16:  # larger passes: the counts they run at
                counts |= {gemm_rows(n, torch.bfloat16) for n in range(rows + 1, most + 1)}
            if not counts:
                continue
            counts = sorted(counts)
            x = torch.zeros(counts[-1], linear.weight.shape[1], dtype=linear.weight.dtype, device=self.device)
            for n in counts:
                linear(x[:n])

    # -- forward -----------------------------------------------------------------------------

    def prefill(self, items: Sequence[PrefillItem]) -> torch.Tensor:
        """One forward over several sequences' chunks; float logits [len(items), vocab] of
        each chunk's last position. Writes the chunks' K/V into the pool."""
        return self.step(items, ())

    def decode(self, items: Sequence[DecodeItem]) -> torch.Tensor:
        """One forward, one new token per sequence; float logits [len(items), vocab]."""
        return self.step((), items)

    @torch.inference_mode()
    def step(self, prefill: Sequence[PrefillItem], decode: Sequence[DecodeItem], commit: bool = True) -> torch.Tensor:
        """Prefill chunks and decode tokens in one forward. Logits rows: prefill items in
        order, then decode items in order. Each sequence may appear at most once, and must hold
        blocks for what it writes (`allocate` / `ensure`; raises KVPoolFull otherwise, before
        any change). After the pass, the full blocks written are named for prefix reuse
        (`commit=False`: not, for scratch tokens)."""
        if not prefill and not decode:
            return torch.empty(0, self.vocab_size, device=self.device)
        rows = self._rows(prefill, decode)
        logits = None
        if self.graphs is not None and not prefill:
            logits = self.graphs.run(rows.tokens, rows.positions, rows.pool_rows,
                                     self.pool.blocks.table_rows(rows.decode_ids, self.blocks_for(max(rows.positions) + 1)))
        if logits is None:
            input_ids, meta, logit_rows = self._tensors(rows)
            logits = self.model(input_ids, meta, self.pool.kv, logit_rows)
        if commit:
            for item in prefill:
                self.pool.commit(item.seq_id)
            bs = self.block_size
            for seq_id, _, pos in decode:  # a decode row fills a block only at the block's last position
                if (pos + 1) % bs == 0:  # (its earlier full blocks were named when they filled, or arrived)
                    self.pool.commit(seq_id)
        return logits

    def _rows(self, prefill, decode) -> "_StepRows":
        """Validate the items, flatten them into token rows (prefill chunks, then decode
        tokens), and advance each sequence's KV length."""
        pool, bs = self.pool, self.block_size
        seen: set = set()
        for item in prefill:
            if not len(item.token_ids):
                raise ValueError(f"empty prefill chunk for sequence {item.seq_id!r}")
            self._claim(item.seq_id, item.start_pos, len(item.token_ids), seen)
        for seq_id, _, pos in decode:
            self._claim(seq_id, pos, 1, seen)
        r = _StepRows()
        for item in prefill:
            n, start = len(item.token_ids), item.start_pos
            table = pool.table(item.seq_id)
            r.chunks.append((start, n, len(r.tokens), table[: -(-(start + n) // bs)] if start else None))
            r.tokens.extend(item.token_ids)
            r.pool_rows.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            r.positions.extend(range(start, start + n))
            r.logit_rows.append(len(r.tokens) - 1)
        r.num_prefill = len(r.tokens)
        for seq_id, token, pos in decode:
            table = pool.table(seq_id)
            r.tokens.append(token)
            r.pool_rows.append(table[pos // bs] * bs + pos % bs)
            r.positions.append(pos)
            r.decode_ids.append(seq_id)
        if min(r.tokens) < 0 or max(r.tokens) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        r.logit_rows.extend(range(r.num_prefill, len(r.tokens)))
        for item in prefill:
            pool.record(item.seq_id, item.start_pos, item.token_ids)
            pool.set_length(item.seq_id, item.start_pos + len(item.token_ids))
        for seq_id, token, pos in decode:
            pool.record(seq_id, pos, (token,))
            pool.set_length(seq_id, pos + 1)
        return r

    def _tensors(self, r: "_StepRows") -> tuple[torch.Tensor, AttnMetadata, torch.Tensor | slice]:
        """The step's rows as tensors on the device, with its attention plan (lists become tensors
        through numpy: `_ints`)."""
        dev, bs = self.device, self.block_size
        chunks = []
        for start, n, row, blocks in r.chunks:
            chunk = PrefillChunk(start, n, row)
            if start:
                q_pos = torch.arange(start, start + n, device=dev)
                chunk.mask = additive_mask(torch.arange(start + n, device=dev)[None, :] <= q_pos[:, None], self.dtype)
                chunk.blocks = _ints(blocks, dev)
            chunks.append(chunk)
        rows = kv_rows(np.asarray(r.pool_rows, dtype=np.int64), np.arange(self.num_kv_heads, dtype=np.int64), bs)
        meta = AttnMetadata(positions=_ints(r.positions, dev), kv_rows=_ints(rows, dev), chunks=chunks,
                            num_prefill_tokens=r.num_prefill, num_decode=len(r.decode_ids))
        if r.decode_ids:
            self._plan_decode(meta, r.decode_ids, r.positions[r.num_prefill:])
        n = len(r.tokens)
        logit_rows = slice(None) if len(r.logit_rows) == n else _ints(r.logit_rows, dev)
        return _ints(r.tokens, dev), meta, logit_rows

    def _claim(self, seq_id, start: int, n: int, seen: set) -> None:
        """Check that positions [start, start + n) can be written for `seq_id`, taking the
        blocks they need."""
        if seq_id in seen:
            raise ValueError(f"sequence {seq_id!r} appears twice in one step")
        seen.add(seq_id)
        have = self.pool.length(seq_id)
        if not 0 <= start <= have:
            raise ValueError(f"sequence {seq_id!r}: position {start} but only {have} positions in KV")
        if start + n > self.max_seq_len:
            raise ValueError(f"sequence {seq_id!r}: {start + n} tokens exceed max_seq_len={self.max_seq_len}")
        self.pool.ensure(seq_id, start + n)

    def _plan_decode(self, meta: AttnMetadata, seq_ids: list, dec_pos: list[int]) -> None:
        width = self.blocks_for(max(dec_pos) + 1)  # the blocks the longest row reads
        lens = [p + 1 for p in dec_pos]
        meta.kernel = self.decode_kernel
        # each row's table, then valid blocks of no meaning, which the kernel never reads (it stops
        # at the row's length) and the gathering path masks
        meta.decode_tables = torch.from_numpy(self.pool.blocks.table_rows(seq_ids, width)).to(self.device)
        meta.decode_lens = _ints(lens, self.device, np.int32)
        if not self.decode_kernel:
            meta.decode_mask = decode_mask(torch.arange(width * self.block_size, device=self.device),
                                           meta.decode_lens, self.dtype)

    # -- KV hand-off -------------------------------------------------------------------------

    @torch.inference_mode()
    def export_kv(self, seq_id: Hashable, length: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of `seq_id`'s K/V for positions [0, length) (default: all it has), one
        (k, v) per layer, each contiguous [num_kv_heads, length, head_dim] in `self.dtype`,
        rotary already applied to k. Safe to keep after `free`."""
        length = self.kv_length(seq_id) if length is None else length
        if length > self.kv_length(seq_id):
            raise ValueError(f"sequence {seq_id!r} has {self.kv_length(seq_id)} positions, asked {length}")
        kv = self.pool.read(seq_id, length)
        return [(layer[0].contiguous(), layer[1].contiguous()) for layer in kv]

    @torch.inference_mode()
    def write_kv(self, seq_id: Hashable, kv: torch.Tensor, tokens: Sequence[int] | None = None,
                 start: int = 0) -> None:
        """Copies a received K/V [num_layers, 2, num_kv_heads, n, head_dim] (any device or dtype)
        into positions [start, start + n) of `seq_id`'s blocks (start: the cached prefix its
        allocation shared, a block boundary) and sets its KV length to start + n. `tokens`: the
        tokens of those positions, so their full blocks join the prefix cache. Safe from another
        thread while forward passes run on other sequences."""
        expected = (self.num_layers, 2, self.num_kv_heads, kv.shape[3], self.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"write_kv: want K/V of shape {expected}, got {tuple(kv.shape)}")
        self.pool.write(seq_id, kv, start, tokens)
        self.pool.commit(seq_id)
