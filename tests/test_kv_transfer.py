"""The KV hand-off wire format fails closed."""

import pytest
import torch

from pdq.transport import kv_transfer
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


def assemble_frames(frames, expect=None):
    asm = kv_transfer.Assembler(expect)
    for frame in frames:
        asm.add_frame(frame)
    return asm.finish()


@pytest.mark.parametrize("chunk_bytes", [100, 1 << 20])
def test_frames_are_the_protobuf_encoding_and_round_trip(chunk_bytes):
    src = layers(n_layers=2, tokens=300)  # 2 layers of 19 KB: offsets past one varint byte
    frames = list(kv_transfer.encode_frames(pb.KVHeader(epoch=7), src, chunk_bytes=chunk_bytes))
    assert frames == [c.SerializeToString() for c in kv_transfer.encode(pb.KVHeader(epoch=7), src, chunk_bytes)]
    got = assemble_frames(frames, expect={"num_layers": 2})
    assert got.header.epoch == 7
    for (k, v), (k2, v2) in zip(src, got.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_frames_fail_closed_on_a_flipped_byte_and_on_truncation():
    frames = list(kv_transfer.encode_frames(pb.KVHeader(), layers(), chunk_bytes=256))
    flipped = frames[5][:-3] + bytes([frames[5][-3] ^ 0xFF]) + frames[5][-2:]
    with pytest.raises(kv_transfer.KVTransferError, match="checksum"):
        assemble_frames(frames[:5] + [flipped] + frames[6:])
    with pytest.raises(kv_transfer.KVTransferError):
        assemble_frames(frames[:5] + [frames[5][:-10]] + frames[6:])
    with pytest.raises(kv_transfer.KVTransferError):
        assemble_frames(frames[:4] + frames[5:])


def test_layout_2_packs_several_layers_into_one_message():
    src = layers(n_layers=3, tokens=37)  # 3 layers of 2 x 2.4 KB: one ~1 MiB message holds them all
    frames = list(kv_transfer.encode_frames(pb.KVHeader(epoch=1), src))
    assert len(frames) == 3 and kv_transfer.num_messages(src, 1 << 20) == 3  # header, data, trailer
    got = assemble_frames(frames)
    assert got.header.layout_version == kv_transfer.LAYOUT_VERSION == 2
    for (k, v), (k2, v2) in zip(src, got.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    # a message cut inside a head, a K/V tensor and a layer still lands in the right place
    cut = list(kv_transfer.encode_frames(pb.KVHeader(), src, chunk_bytes=1000))
    assert len(cut) == kv_transfer.num_messages(src, 1000) > 10
    for (k, v), (k2, v2) in zip(src, assemble_frames(cut).layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_a_flipped_byte_in_a_multi_layer_message_is_rejected():
    frames = list(kv_transfer.encode_frames(pb.KVHeader(), layers(n_layers=3)))
    data = bytearray(frames[1])
    data[len(data) // 2] ^= 0x01  # inside layer 1's payload, in the message that holds all 3
    with pytest.raises(kv_transfer.KVTransferError, match="checksum"):
        assemble_frames([frames[0], bytes(data), frames[2]])


def test_old_layout_and_misaligned_chunks_are_rejected():
    header = next(kv_transfer.encode(pb.KVHeader(), layers()))
    old = pb.KVChunk()
    old.CopyFrom(header)
    old.header.layout_version = 1
    with pytest.raises(kv_transfer.KVTransferError, match="layout version 1"):
        kv_transfer.decode([old])
    with pytest.raises(kv_transfer.KVTransferError, match="3 bytes at offset 0"):  # float32: whole elements only
        kv_transfer.decode([header, pb.KVChunk(data=pb.KVData(offset=0, data=b"abc"))])
    with pytest.raises(kv_transfer.KVTransferError, match="out of order"):  # a gap
        kv_transfer.decode([header, pb.KVChunk(data=pb.KVData(offset=8, data=b"abcd"))])


def test_scatter_writes_only_the_sent_positions_of_a_pool_slot():
    src = layers(n_layers=2, heads=3, tokens=5, dim=4)
    header = pb.KVHeader()
    frames = list(kv_transfer.encode(header, src, chunk_bytes=24))  # 6 floats: cuts across heads
    slot = torch.full((2, 2, 3, 16, 4), 7.0)  # a slot with room for 16 positions
    for chunk in frames[1:-1]:
        d = chunk.data
        kv_transfer.scatter(header, d.offset // 4, kv_transfer.tensor_of(d.data, torch.float32), slot)
    for layer, (k, v) in enumerate(src):
        assert torch.equal(slot[layer, 0, :, :5], k) and torch.equal(slot[layer, 1, :, :5], v)
    assert torch.all(slot[:, :, :, 5:] == 7.0)


def test_hand_offs_of_one_prefix_share_its_blocks_and_write_only_the_rest():
    """A decode worker's sink: two hand-offs whose prompts share 48 tokens (three full blocks);
    the second takes those blocks from the pool's prefix cache and writes only its own positions."""
    from decode_worker.kv_receive import BlockSink
    from pdq.engine.runner import ModelRunner
    from pdq.model.builtin import build_model
    from pdq.v1 import generation_pb2 as gen_pb

    runner = ModelRunner(build_model("tiny"), kv_budget_tokens=512, max_seq_len=256)
    shape = (runner.num_kv_heads, 50, runner.head_dim)
    system = list(range(3, 51))  # 48 tokens

    def hand_off(rid: str, tail: list[int], seed: int):
        g = torch.Generator().manual_seed(seed)
        kv = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(runner.num_layers)]
        header = pb.KVHeader(spec=pb.RequestSpec(request_id=rid, prompt_token_ids=system + tail,
                                                 sampling=gen_pb.SamplingParams(max_tokens=2)),
                             epoch=1, generated_token_ids=[1])
        assembler = kv_transfer.Assembler(sink=BlockSink(runner, admit=lambda h: None))
        for frame in kv_transfer.encode_frames(header, kv):
            assembler.add_frame(frame)
        return kv, assembler.finish().key

    first, _ = hand_off("s1", [7, 8], seed=1)
    blocks_used = runner.usage().blocks_used
    second, key = hand_off("s2", [9, 10], seed=2)
    assert runner.pool.blocks.hit_tokens == 48  # the second found the first's three blocks
    assert runner.usage().blocks_used == blocks_used + 1  # its own: one block for positions 48..51
    for (k, v), (k1, v1), (k2, v2) in zip(runner.export_kv(key), first, second):
        assert torch.equal(k[:, :48], k1[:, :48]) and torch.equal(v[:, :48], v1[:, :48])  # shared
        assert torch.equal(k[:, 48:], k2[:, 48:]) and torch.equal(v[:, 48:], v2[:, 48:])  # its own


def test_a_hand_off_that_skips_leading_positions_carries_only_the_rest_and_says_how_many():
    full = layers(tokens=40)
    sent = [(k[:, 16:], v[:, 16:]) for k, v in full]
    header = pb.KVHeader(spec=pb.RequestSpec(request_id="r"), epoch=1, skip_tokens=16)
    got = kv_transfer.decode(kv_transfer.encode(header, sent))
    assert (got.header.num_tokens, got.header.skip_tokens, kv_transfer.sent_tokens(got.header)) == (40, 16, 24)
    for (k, v), (gk, gv) in zip(sent, got.layers):
        assert torch.equal(k, gk) and torch.equal(v, gv)
    whole = sum(len(f) for f in kv_transfer.encode_frames(pb.KVHeader(), full))
    assert sum(len(f) for f in kv_transfer.encode_frames(header, sent)) < whole * 24 / 40 + 256


def test_a_header_that_skips_every_position_is_rejected():
    header = pb.KVHeader(spec=pb.RequestSpec(request_id="r"), epoch=1, skip_tokens=0)
    chunks = list(kv_transfer.encode(header, layers(tokens=4)))
    chunks[0].header.skip_tokens = 4
    with pytest.raises(kv_transfer.KVTransferError, match="skip_tokens"):
        kv_transfer.decode(chunks)
