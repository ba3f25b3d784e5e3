"""Attention over the slot KV pool, for one forward that mixes prefill chunks and decode tokens.

Row layout of a forward of T tokens: first the prefill chunks, each a contiguous run of
rows, then one row per decoding sequence. `AttnMetadata` says where each row's K/V goes in
the pool and what it may attend to; the runner builds it once per step, every layer shares it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk: rows [row, row + length) are its positions [start, start + length).

    `mask` is None when start == 0 (plain causal), else an additive mask [length,
    start + length] (see `additive_mask`).
    """

    slot: int
    start: int
    length: int
    row: int
    mask: torch.Tensor | None


@dataclass
class AttnMetadata:
    """Per-step attention plan shared by all layers.

    positions: long [T], position of every row (for rotary).
    kv_rows: long [T * kv_heads], row of each (token, kv head) in the layer's pool viewed as
        [num_slots * kv_heads * max_seq_len, head_dim]: where this step's K/V is written.
    decode_span: decode attention runs batched over pool slots [0, decode_span), a view.
    decode_len: keys [0, decode_len) are read for decode, the longest decoding context.
    decode_mask: additive [decode_span, 1, 1, decode_len], or None when all keys are visible.
    decode_slots: long [B] slot of each decode row; None when they are exactly 0..span-1.
    decode_groups: when set, decode attention runs per group of consecutive slots instead,
        each (first slot, end slot, keys read, additive mask [end - first, 1, 1, keys] or None),
        so a group of short sequences does not read as far as the batch's longest
        (`kv_order`); every slot in [0, span) decodes.
    decode_order: with decode_groups, long [span] decode row of each slot; None when rows are
        already in slot order.
    """

    positions: torch.Tensor
    kv_rows: torch.Tensor
    chunks: list[PrefillChunk]
    num_prefill_tokens: int
    num_decode: int
    decode_span: int = 0
    decode_len: int = 0
    decode_mask: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_groups: list[tuple[int, int, int, torch.Tensor | None]] | None = None
    decode_order: torch.Tensor | None = None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: built once per step, so SDPA does not convert a
    bool mask in every layer. Every query row must allow at least one key."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend. Returns [T, q_heads, head_dim].

    q: [T, q_heads, head_dim]; k, v: [T, kv_heads, head_dim] (rotary already applied).
    k_cache, v_cache: this layer's contiguous pool tensors [num_slots, kv_heads, max_seq_len,
    head_dim]; written in place at meta.kv_rows.
    """
    head_dim = k.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, meta.kv_rows, k.reshape(-1, head_dim))
    v_cache.view(-1, head_dim).index_copy_(0, meta.kv_rows, v.reshape(-1, head_dim))
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for c in meta.chunks:
        qc = q[c.row : c.row + c.length].transpose(0, 1).unsqueeze(0)
        end = c.start + c.length
        kc = k_cache[c.slot, :, :end].unsqueeze(0)
        vc = v_cache[c.slot, :, :end].unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=gqa
        )
        outs.append(o[0].transpose(0, 1))
    if meta.num_decode:
        outs.append(_decode(q[meta.num_prefill_tokens :], k_cache, v_cache, meta))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode(q, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
    """One query per decoding sequence, batched over the contiguous slot range [0, span).

    The query heads sharing a kv head are folded into the query-length dim,
    [B, kv_heads, group, head_dim]: each K/V block is read once per group, not repeated.
    """
    span, length = meta.decode_span, meta.decode_len
    num_kv_heads = k_cache.shape[1]
    b, num_heads, head_dim = q.shape
    q = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if meta.decode_groups is not None:
        return _decode_groups(q, k_cache, v_cache, meta).reshape(b, num_heads, head_dim)
    if meta.decode_slots is not None:  # scatter into the slot range; other rows are ignored
        full = q.new_zeros(span, *q.shape[1:])
        full[meta.decode_slots] = q
        q = full
    o = F.scaled_dot_product_attention(
        q, k_cache[:span, :, :length], v_cache[:span, :, :length], attn_mask=meta.decode_mask
    )
    if meta.decode_slots is not None:
        o = o[meta.decode_slots]
    return o.reshape(b, num_heads, head_dim)


def _decode_groups(q, k_cache, v_cache, meta: AttnMetadata) -> torch.Tensor:
    """`_decode` over consecutive slot groups, each reading keys up to its own longest."""
    order = meta.decode_order
    if order is not None:
        q = q[order]  # rows in slot order
    o = torch.cat([
        F.scaled_dot_product_attention(q[first:end], k_cache[first:end, :, :keys], v_cache[first:end, :, :keys],
                                       attn_mask=mask)
        for first, end, keys, mask in meta.decode_groups
    ])
    if order is not None:
        rows = torch.empty_like(o)
        rows[order] = o
        o = rows
    return o
