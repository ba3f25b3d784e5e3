"""The KV hand-off wire format fails closed."""

import pytest
import torch

from pdq import kv_transfer
from pdq.v1 import internal_pb2 as pb


def layers(n_layers=3, heads=2, tokens=37, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(heads, tokens, dim, generator=g).to(dtype), torch.randn(heads, tokens, dim, generator=g).to(dtype))
            for _ in range(n_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_in_small_chunks(dtype):
    src = layers(dtype=dtype)
    chunks = list(kv_transfer.encode(pb.KVHeader(epoch=3), src, chunk_bytes=100))
    assert sum(c.WhichOneof("part") == "data" for c in chunks) > 3 * 2
    got = kv_transfer.decode(chunks, expect={"num_layers": 3, "head_dim": 8})
    assert got.header.epoch == 3 and got.header.num_tokens == 37
    for (k, v), (k2, v2) in zip(src, got.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_a_flipped_byte_is_rejected():
    chunks = list(kv_transfer.encode(pb.KVHeader(), layers(), chunk_bytes=256))
    data = bytearray(chunks[5].data.data)
    data[10] ^= 0xFF
    chunks[5].data.data = bytes(data)
    with pytest.raises(kv_transfer.KVTransferError, match="checksum"):
        kv_transfer.decode(chunks)


def test_a_missing_chunk_or_trailer_is_rejected():
    chunks = list(kv_transfer.encode(pb.KVHeader(), layers(), chunk_bytes=256))
    with pytest.raises(kv_transfer.KVTransferError):
        kv_transfer.decode(chunks[:4] + chunks[5:])
    with pytest.raises(kv_transfer.KVTransferError, match="ended"):
        kv_transfer.decode(chunks[:-1])


def test_a_different_model_is_rejected():
    chunks = list(kv_transfer.encode(pb.KVHeader(), layers(), chunk_bytes=256))
    with pytest.raises(kv_transfer.KVTransferError, match="num_layers"):
        kv_transfer.decode(chunks, expect={"num_layers": 4})
