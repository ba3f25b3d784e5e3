"""Attention over the paged KV pool, for one forward that mixes prefill chunks and decode tokens.

Row layout of a forward of T tokens: first the prefill chunks, each a contiguous run of rows,
then one row per decoding sequence. `AttnMetadata` says where each row's K/V goes in the pool
and what it may attend to; the runner builds it once per step, every layer shares it.

- A chunk starting at position 0 attends to its own keys (causal), straight from this step's k, v.
- A chunk starting later (chunked prefill, or a prompt whose prefix was cached) reads its
  earlier keys from its blocks (a gather of that one sequence) and attends with a causal mask.
- Decode rows read each sequence's blocks in place through its block table: on CPU with the C
  kernel (`cpu_kernels`), elsewhere by gathering the step's blocks and one batched SDPA.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdq.engine import cpu_kernels


@dataclass
class PrefillChunk:
    """One sequence's chunk: rows [row, row + length) are its positions [start, start + length).

    blocks: long [ceil((start + length) / block_size)] its block table, when start > 0.
    mask: additive [length, start + length] when start > 0 (see `additive_mask`).
    """

    start: int
    length: int
    row: int
    blocks: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttnMetadata:
    """Per-step attention plan shared by all layers.

    positions: long [T], position of every row (for rotary).
    kv_rows: long [T * kv_heads], row of each (token, kv head) in the layer's pool viewed as
        [num_blocks * kv_heads * block_size, head_dim]: where this step's K/V is written.
    decode_tables: int32 [B, max_blocks], each decoding sequence's block table (padded).
    decode_lens: int32 [B], keys each decode row reads (its position + 1).
    decode_mask: for the gather path, additive [B, 1, 1, max_blocks * block_size].
    kernel: decode rows run the CPU kernel (else the gather path).
    """

    positions: torch.Tensor
    kv_rows: torch.Tensor
    chunks: list[PrefillChunk]
    num_prefill_tokens: int
    num_decode: int
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    kernel: bool = False


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: built once per step, so SDPA does not convert a
    bool mask in every layer. Every query row must allow at least one key."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def kv_rows(pool_rows, heads, block_size: int):
    """Rows (block * block_size + offset) of a step's tokens -> their rows in a layer's pool viewed
    as [num_blocks * kv_heads * block_size, head_dim], one per (token, kv head); `heads` is
    arange(kv_heads). Tensors or numpy arrays (int64) alike."""
    return (((pool_rows // block_size)[:, None] * heads.shape[0] + heads) * block_size
            + (pool_rows % block_size)[:, None]).reshape(-1)


def decode_mask(keys: torch.Tensor, lens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gather path's mask: row b sees keys [0, lens[b]) of `keys` (arange of the padded
    width in positions). -> additive [B, 1, 1, len(keys)]."""
    return additive_mask((keys[None, :] < lens[:, None]).view(lens.shape[0], 1, 1, -1), dtype)


def gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[len(blocks), kv_heads, bs, D] blocks of a layer's cache -> [kv_heads, len(blocks) * bs, D]."""
    got = cache.index_select(0, blocks)
    n, heads, bs, dim = got.shape
    return got.transpose(0, 1).reshape(heads, n * bs, dim)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
    stored: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into the pool (unless `stored`: already written), then attend.
    Returns [T, q_heads, head_dim].

    q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim] (rotary already applied).
    k_cache, v_cache: this layer's pool tensors [num_blocks, kv_heads, block_size, head_dim];
    written in place at meta.kv_rows.
    """
    if not stored:
        head_dim = k.shape[-1]
        k_cache.view(-1, head_dim).index_copy_(0, meta.kv_rows, k.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, meta.kv_rows, v.reshape(-1, head_dim))
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for c in meta.chunks:
        qc = q[c.row : c.row + c.length].transpose(0, 1)
        if c.blocks is None:  # from position 0: its keys are this step's
            kc = k[c.row : c.row + c.length].transpose(0, 1)
            vc = v[c.row : c.row + c.length].transpose(0, 1)
        else:
            end = c.start + c.length
            kc, vc = gather(k_cache, c.blocks)[:, :end], gather(v_cache, c.blocks)[:, :end]
        # 4-D (a batch of one): with 3-D inputs torch's CPU SDPA takes its unfused math path
        # (a safe softmax over materialized scores), 2-3x slower than its flash kernel
        o = F.scaled_dot_product_attention(qc[None], kc[None], vc[None], attn_mask=c.mask, is_causal=c.mask is None,
                                           enable_gqa=gqa)[0]
        outs.append(o.transpose(0, 1))
    if meta.num_decode:
        outs.append(_decode(q[meta.num_prefill_tokens :], k_cache, v_cache, meta))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode(q, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
    """One query per decoding sequence, each over its own blocks."""
    if meta.kernel:
        return cpu_kernels.paged_decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens,
                                        1 / math.sqrt(q.shape[-1]))
    b, num_heads, head_dim = q.shape
    tables = meta.decode_tables.long()
    blocks = k_cache.index_select(0, tables.view(-1))
    n, kv_heads, bs, _ = blocks.shape
    keys = blocks.view(b, n // b, kv_heads, bs, head_dim).transpose(1, 2).reshape(b, kv_heads, -1, head_dim)
    values = (v_cache.index_select(0, tables.view(-1)).view(b, n // b, kv_heads, bs, head_dim)
              .transpose(1, 2).reshape(b, kv_heads, -1, head_dim))
    # the query heads sharing a kv head fold into the query-length dim: each key is read once per group
    q = q.view(b, kv_heads, num_heads // kv_heads, head_dim)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask)
    return o.reshape(b, num_heads, head_dim)
