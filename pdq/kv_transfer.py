"""The KV hand-off wire format: a header, per-layer data chunks, a CRC-32 trailer.

Pure: turns tensors into `KVChunk` messages and back, checking everything on the way in (fails
closed: any mismatch raises `KVTransferError` and yields nothing to decode). Layout version 1:
for each layer, K then V, each a contiguous [num_kv_heads, num_tokens, head_dim] tensor.
"""

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pdq.v1 import internal_pb2 as pb

LAYOUT_VERSION = 1


class KVTransferError(Exception):
    """A hand-off that must not be used: corrupt, truncated, or not what the header said."""


def encode(header: pb.KVHeader, layers: list[tuple[torch.Tensor, torch.Tensor]],
           chunk_bytes: int = 1 << 20) -> Iterator[pb.KVChunk]:
    """Yields the messages of one hand-off. `layers[i]` = (k, v) of layer i, shape
    [num_kv_heads, num_tokens, head_dim]; the header's layout fields are filled in here."""
    k0 = layers[0][0]
    header.num_layers = len(layers)
    header.num_kv_heads, header.num_tokens, header.head_dim = (int(x) for x in k0.shape)
    header.dtype = str(k0.dtype).removeprefix("torch.")
    header.layout_version = LAYOUT_VERSION
    yield pb.KVChunk(header=header)
    crc, total = 0, 0
    for layer, pair in enumerate(layers):
        for kind, tensor in enumerate(pair):
            data = _as_bytes(tensor)
            for offset in range(0, len(data), chunk_bytes):
                piece = data[offset:offset + chunk_bytes]
                crc = zlib.crc32(piece, crc)
                total += len(piece)
                yield pb.KVChunk(data=pb.KVData(layer=layer, kind=kind, offset=offset, data=bytes(piece)))
    yield pb.KVChunk(trailer=pb.KVTrailer(crc32=crc, total_bytes=total))


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ReceivedKV:
    header: pb.KVHeader
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # CPU tensors, [num_kv_heads, num_tokens, head_dim]


def decode(chunks: Iterable[pb.KVChunk], expect: dict | None = None) -> ReceivedKV:
    """Assembles a hand-off from its messages (sync iterable). See `Assembler` for streams."""
    asm = Assembler(expect)
    for chunk in chunks:
        asm.add(chunk)
    return asm.finish()


class Assembler:
    """Collects one hand-off message by message; `finish()` validates and returns the tensors.

    `expect` may pin num_layers / num_kv_heads / head_dim / dtype to the receiver's model.
    """

    def __init__(self, expect: dict | None = None):
        self.expect = expect or {}
        self.header: pb.KVHeader | None = None
        self.buffers: list[list[bytearray]] = []
        self.crc = 0
        self.total = 0
        self.trailer: pb.KVTrailer | None = None

    def add(self, chunk: pb.KVChunk) -> None:
        part = chunk.WhichOneof("part")
        if part == "header":
            self._on_header(chunk.header)
        elif part == "data":
            self._on_data(chunk.data)
        elif part == "trailer":
            if self.header is None or self.trailer is not None:
                raise KVTransferError("trailer out of order")
            self.trailer = chunk.trailer
        else:
            raise KVTransferError("empty KV chunk")

    def _on_header(self, h: pb.KVHeader) -> None:
        if self.header is not None:
            raise KVTransferError("second header")
        if h.layout_version != LAYOUT_VERSION:
            raise KVTransferError(f"layout version {h.layout_version}, expected {LAYOUT_VERSION}")
        if h.dtype not in _DTYPES:
            raise KVTransferError(f"unknown dtype {h.dtype!r}")
        for name, want in self.expect.items():
            if getattr(h, name) != want:
                raise KVTransferError(f"{name} is {getattr(h, name)}, this worker's model has {want}")
        if h.num_tokens == 0 or h.num_layers == 0:
            raise KVTransferError("empty KV cache")
        self.header = h
        size = h.num_kv_heads * h.num_tokens * h.head_dim * _DTYPES[h.dtype].itemsize
        self.buffers = [[bytearray(size), bytearray(size)] for _ in range(h.num_layers)]
        self.filled = [[0, 0] for _ in range(h.num_layers)]

    def _on_data(self, d: pb.KVData) -> None:
        if self.header is None or self.trailer is not None:
            raise KVTransferError("data before header or after trailer")
        if d.layer >= len(self.buffers) or d.kind > 1:
            raise KVTransferError(f"bad chunk address layer={d.layer} kind={d.kind}")
        buf = self.buffers[d.layer][d.kind]
        if d.offset != self.filled[d.layer][d.kind] or d.offset + len(d.data) > len(buf):
            raise KVTransferError(f"chunk at offset {d.offset} out of order or too large")
        buf[d.offset:d.offset + len(d.data)] = d.data
        self.filled[d.layer][d.kind] += len(d.data)
        self.crc = zlib.crc32(d.data, self.crc)
        self.total += len(d.data)

    def finish(self) -> ReceivedKV:
        h = self.header
        if h is None or self.trailer is None:
            raise KVTransferError("hand-off ended before its header and trailer")
        if self.trailer.total_bytes != self.total or self.trailer.crc32 != self.crc:
            raise KVTransferError("checksum mismatch: KV cache corrupted in transit")
        if any(f != len(b) for fl, bl in zip(self.filled, self.buffers) for f, b in zip(fl, bl)):
            raise KVTransferError("hand-off is missing chunks")
        dtype = _DTYPES[h.dtype]
        shape = (h.num_kv_heads, h.num_tokens, h.head_dim)
        layers = [(_tensor(k, dtype, shape), _tensor(v, dtype, shape)) for k, v in self.buffers]
        return ReceivedKV(h, layers)


def _tensor(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).view(shape)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
