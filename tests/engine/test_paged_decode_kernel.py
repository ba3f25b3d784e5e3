"""The paged decode attention kernel (`cpu_kernels.paged_decode`) against plain torch, over
the shapes its work split takes: several sequences per thread (each item a sequence's blocks,
all heads), and fewer sequences than threads (a sequence's heads split into parts); and over
the head sizes and query groups it has code of its own for (D 64 and 128 with G 1, 2, 4, 8, or
another G) and others (read at run time)."""

import math

import pytest
import torch

from pdq.engine import cpu_kernels


def reference(q, k_cache, v_cache, tables, lens):
    """Each row over its own keys, gathered from its blocks, in float64."""
    b, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(b, heads, dim, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)].long()
        keys = k_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n].double()
        values = v_cache[blocks].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n].double()
        qi = q[i].double().view(kv_heads, heads // kv_heads, dim)
        weights = torch.softmax(qi @ keys.transpose(1, 2) / math.sqrt(dim), dim=-1)
        out[i] = (weights @ values).reshape(heads, dim)
    return out


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("batch,kv_heads,group,dim", [(1, 4, 2, 64), (2, 3, 2, 32), (3, 1, 4, 16), (5, 4, 1, 64),
                                                      (24, 2, 2, 32), (4, 2, 8, 64), (2, 2, 3, 64), (2, 1, 4, 64),
                                                      (3, 2, 4, 128), (2, 1, 1, 128), (2, 2, 2, 128),
                                                      (2, 1, 8, 128), (2, 2, 5, 128), (2, 2, 2, 80)])
def test_paged_decode_matches_torch(batch, kv_heads, group, dim, threads):
    assert cpu_kernels.available()  # CI has a C compiler: the kernel must be what runs here
    gen = torch.Generator().manual_seed(batch * 100 + kv_heads * 10 + group)
    bs = 16
    lens = torch.randint(1, 150, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 1  # a sequence of one key, and one ending exactly on a block
    if batch > 1:
        lens[1] = 2 * bs
    max_blocks = int(-(-int(lens.max()) // bs))
    num_blocks = batch * max_blocks + 3
    # each sequence's blocks anywhere in the pool, in no order
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=gen)
    v_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=gen)
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits its work by the thread count
    try:
        out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(dim))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch,kv_heads,group,dim", [(1, 4, 2, 64), (3, 1, 4, 16), (24, 2, 2, 32), (2, 2, 8, 64),
                                                      (3, 2, 4, 128), (2, 2, 3, 128)])
def test_paged_decode_of_bfloat16_tensors_matches_torch(batch, kv_heads, group, dim, threads):
    """bfloat16 q, keys and values (a bfloat16 model's pool): the kernel reads them as they are,
    computes in float32 and writes bfloat16, within bfloat16's precision of the exact result."""
    gen = torch.Generator().manual_seed(batch * 100 + kv_heads * 10 + group)
    bs = 16
    lens = torch.randint(1, 150, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 1
    max_blocks = int(-(-int(lens.max()) // bs))
    num_blocks = batch * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    k_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, kv_heads, bs, dim, generator=gen).bfloat16()
    q = torch.randn(batch, kv_heads * group, dim, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 1 / math.sqrt(dim))
    finally:
        torch.set_num_threads(before)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, lens), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="must match"):
        cpu_kernels.paged_decode(q.float(), k_cache, v_cache, tables, lens, 1.0)
