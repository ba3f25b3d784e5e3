"""The KV hand-off wire format: a header, ~1 MiB data chunks, a checksum trailer (XXH3-64).

Pure: turns tensors into `KVChunk` messages and back, checking everything on the way in (fails
closed: any mismatch raises `KVTransferError` and yields nothing to decode). Layout version 2:
the cache is one byte stream, for each layer K then V, each a contiguous [num_kv_heads,
sent tokens, head_dim] tensor (the sent tokens: positions `skip_tokens`..`num_tokens`-1, all of
them unless the receiver's prefix cache holds the leading ones, `sent_tokens`); each `KVData`
carries the bytes at `offset` of that stream, cut every `chunk_bytes` (rounded to the dtype's
size), so a message may hold several small layers or part of a big one. The receiver writes each
chunk where it belongs (`KVSink`): into staging tensors (`BufferSink`) or straight into a KV pool
slot (the decode worker).
"""

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import xxhash
from google.protobuf.message import DecodeError

from pdq.v1 import internal_pb2 as pb

LAYOUT_VERSION = 2


class KVTransferError(Exception):
    """A hand-off that must not be used: corrupt, truncated, or not what the header said."""


def sent_tokens(h: pb.KVHeader) -> int:
    """Positions whose K/V a hand-off carries: all but the `skip_tokens` leading ones."""
    return h.num_tokens - h.skip_tokens


def _fill_header(header: pb.KVHeader, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The layout fields, from the sent K/V (positions from header.skip_tokens on)."""
    k0 = layers[0][0]
    header.num_layers = len(layers)
    header.num_kv_heads, sent, header.head_dim = (int(x) for x in k0.shape)
    header.num_tokens = header.skip_tokens + sent
    header.dtype = str(k0.dtype).removeprefix("torch.")
    header.layout_version = LAYOUT_VERSION


def _chunks(layers: list[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int) -> Iterator[tuple[int, list[memoryview]]]:
    """(stream offset, pieces of tensor memory) of each data message, in stream order."""
    tensors = [_as_bytes(t) for pair in layers for t in pair]
    itemsize = layers[0][0].element_size()
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    offset, pieces, room = 0, [], step
    for data in tensors:
        i = 0
        while i < len(data):
            piece = data[i:i + room]
            pieces.append(piece)
            i += len(piece)
            room -= len(piece)
            if not room:
                yield offset, pieces
                offset, pieces, room = offset + step, [], step
    if pieces:
        yield offset, pieces


def num_messages(layers: list[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int) -> int:
    """Messages of one hand-off (header, data chunks, trailer)."""
    total = sum(t.numel() * t.element_size() for pair in layers for t in pair)
    itemsize = layers[0][0].element_size()
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    return 2 + -(-total // step)


def encode(header: pb.KVHeader, layers: list[tuple[torch.Tensor, torch.Tensor]],
           chunk_bytes: int = 1 << 20) -> Iterator[pb.KVChunk]:
    """Yields the messages of one hand-off. `layers[i]` = (k, v) of layer i, shape
    [num_kv_heads, sent tokens, head_dim] (positions from header.skip_tokens on); the header's
    layout fields are filled in here."""
    _fill_header(header, layers)
    yield pb.KVChunk(header=header)
    digest, total = xxhash.xxh3_64(), 0
    for offset, pieces in _chunks(layers, chunk_bytes):
        data = b"".join(pieces)
        digest.update(data)
        total += len(data)
        yield pb.KVChunk(data=pb.KVData(offset=offset, data=data))
    yield pb.KVChunk(trailer=pb.KVTrailer(xxh3_64=digest.intdigest(), total_bytes=total))


def encode_frames(header: pb.KVHeader, layers: list[tuple[torch.Tensor, torch.Tensor]],
                  chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The same hand-off as `encode`, as serialized `KVChunk` messages (byte-identical to
    `SerializeToString`), built straight from the tensors' memory: each payload is copied once,
    into its frame, instead of into a bytes object, a protobuf message and then its encoding."""
    _fill_header(header, layers)
    yield pb.KVChunk(header=header).SerializeToString()
    digest, total = xxhash.xxh3_64(), 0
    for offset, pieces in _chunks(layers, chunk_bytes):
        for piece in pieces:
            digest.update(piece)
            total += len(piece)
        yield data_frame(offset, pieces)
    yield pb.KVChunk(trailer=pb.KVTrailer(xxh3_64=digest.intdigest(), total_bytes=total)).SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_frame(offset: int, pieces: list[memoryview]) -> bytes:
    """The wire bytes of KVChunk(data=KVData(offset, data=b"".join(pieces))), one copy."""
    n = sum(len(p) for p in pieces)
    fields = b"".join([b"\x18" + _varint(offset) if offset else b"", b"\x22" + _varint(n) if n else b""])
    return b"".join([b"\x12", _varint(len(fields) + n), fields, *pieces])


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise KVTransferError("malformed varint in a KV chunk")


def parse_frame(frame: bytes) -> "pb.KVChunk | RawData":
    """A serialized KVChunk -> its KVData part as (offset, payload view) without copying the
    payload, or the whole KVChunk (header, trailer) parsed by protobuf."""
    buf = memoryview(frame)
    try:
        if len(buf) < 2 or buf[0] != 0x12:
            return pb.KVChunk.FromString(frame)
        size, i = _read_varint(buf, 1)
        if i + size != len(buf):
            raise KVTransferError("KV chunk with a bad length")
        offset = 0
        payload = buf[0:0]
        while i < len(buf):
            tag, i = _read_varint(buf, i)
            if tag == 0x22:
                n, i = _read_varint(buf, i)
                if i + n > len(buf):
                    raise KVTransferError("truncated KV chunk")
                payload, i = buf[i:i + n], i + n
            elif tag == 0x18:
                offset, i = _read_varint(buf, i)
            else:  # a field this reader does not know: let protobuf do it
                return pb.KVChunk.FromString(frame)
        if i != len(buf):
            raise KVTransferError("KV chunk with a bad length")
        return RawData(offset, payload)
    except IndexError:
        raise KVTransferError("truncated KV chunk") from None
    except DecodeError as exc:
        raise KVTransferError(f"malformed KV chunk: {exc}") from None


@dataclass
class RawData:
    """A KVData whose payload is a view into the received frame."""

    offset: int
    data: memoryview


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit words
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# tensor_of views received (read-only) frames, which it only reads: torch's warning about
# that is noise (a filter set once: catch_warnings per call would not be thread-safe)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def tensor_of(data: "bytes | bytearray | memoryview", dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor viewing `data` (no copy). Read-only bytes are fine: the tensor is only read."""
    if dtype == torch.bfloat16:
        return torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16)
    return torch.frombuffer(data, dtype=dtype)


def scatter(h: pb.KVHeader, offset: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies the stream's elements [offset, offset + len(src)) (in elements, layout 2) into
    `dst`, a [num_layers, 2, num_kv_heads, >= sent tokens, head_dim] tensor whose last two dims
    are contiguous per head (a staging buffer, or a KV pool slot)."""
    heads, tokens, dim = h.num_kv_heads, sent_tokens(h), h.head_dim
    per_head = tokens * dim
    per_tensor = heads * per_head
    dst = dst.flatten(0, 1)  # [layers * 2, heads, seq, dim]
    if dst.device.type == "cpu" and src.device.type == "cpu":
        # numpy copies these small strided blocks faster than copy_: it starts no intra-op threads
        dst, src = _as_numpy(dst), _as_numpy(src)
        copy = np.copyto
    else:
        def copy(d: torch.Tensor, s: torch.Tensor) -> None:
            d.copy_(s)
    i, end = 0, len(src)
    while i < end:
        tensor, within = divmod(offset + i, per_tensor)
        if within == 0 and end - i >= per_tensor:  # a whole K or V: one strided copy
            copy(dst[tensor, :, :tokens], src[i:i + per_tensor].reshape(heads, tokens, dim))
            i += per_tensor
            continue
        head, pos = divmod(within, per_head)
        n = min(per_head - pos, end - i)
        copy(dst[tensor, head].reshape(-1)[pos:pos + n], src[i:i + n])
        i += n


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as int16: the same bytes)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


class KVSink(Protocol):
    """Where a hand-off's bytes go. `open` may refuse (raise); `write` gets the stream's bytes at
    `offset` (in order, whole elements); `close` runs after every check passed."""

    def open(self, header: pb.KVHeader) -> None: ...

    def write(self, offset: int, data: memoryview) -> None: ...

    def close(self) -> Any: ...


@dataclass
class ReceivedKV:
    header: pb.KVHeader
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # CPU tensors, [num_kv_heads, sent tokens, head_dim]


class BufferSink:
    """Receives into fresh CPU tensors; `close()` -> ReceivedKV."""

    def open(self, header: pb.KVHeader) -> None:
        self.header = header
        self.dtype = _DTYPES[header.dtype]
        self.buf = torch.empty(header.num_layers, 2, header.num_kv_heads, sent_tokens(header), header.head_dim,
                               dtype=self.dtype)

    def write(self, offset: int, data: memoryview) -> None:
        scatter(self.header, offset // self.dtype.itemsize, tensor_of(data, self.dtype), self.buf)

    def close(self) -> ReceivedKV:
        return ReceivedKV(self.header, [(layer[0], layer[1]) for layer in self.buf])


def decode(chunks: Iterable[pb.KVChunk], expect: dict | None = None) -> ReceivedKV:
    """Assembles a hand-off from its messages (sync iterable). See `Assembler` for streams."""
    asm = Assembler(expect)
    for chunk in chunks:
        asm.add(chunk)
    return asm.finish()


class Assembler:
    """Checks one hand-off message by message and passes its bytes to a sink (default: a
    `BufferSink`); `finish()` checks sizes and the checksum and returns `sink.close()`.
    Any error raises KVTransferError; the caller then discards what the sink got.

    `expect` may pin num_layers / num_kv_heads / head_dim / dtype to the receiver's model.
    """

    def __init__(self, expect: dict | None = None, sink: KVSink | None = None):
        self.expect = expect or {}
        self.sink = sink if sink is not None else BufferSink()
        self.header: pb.KVHeader | None = None
        self.size = 0  # bytes the header announces
        self.itemsize = 1
        self.digest = xxhash.xxh3_64()
        self.total = 0
        self.trailer: pb.KVTrailer | None = None

    def add_frame(self, frame: bytes) -> None:
        """Adds one serialized KVChunk (see `parse_frame`): the payload is not copied before the sink."""
        got = parse_frame(frame)
        if isinstance(got, RawData):
            self._on_data(got)
        else:
            self.add(got)

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
        if h.num_tokens == 0 or h.num_layers == 0 or h.num_kv_heads == 0 or h.head_dim == 0:
            raise KVTransferError("empty KV cache")
        if h.skip_tokens >= h.num_tokens:
            raise KVTransferError(f"skip_tokens {h.skip_tokens} leaves none of the {h.num_tokens} positions to send")
        self.itemsize = _DTYPES[h.dtype].itemsize
        self.size = h.num_layers * 2 * h.num_kv_heads * sent_tokens(h) * h.head_dim * self.itemsize
        self.sink.open(h)
        self.header = h

    def _on_data(self, d: "pb.KVData | RawData") -> None:
        if self.header is None or self.trailer is not None:
            raise KVTransferError("data before header or after trailer")
        n = len(d.data)
        if d.offset != self.total or self.total + n > self.size or n % self.itemsize:
            raise KVTransferError(f"chunk of {n} bytes at offset {d.offset} out of order or too large")
        self.digest.update(d.data)
        self.sink.write(d.offset, memoryview(d.data))
        self.total += n

    def finish(self) -> Any:
        if self.header is None or self.trailer is None:
            raise KVTransferError("hand-off ended before its header and trailer")
        if self.trailer.total_bytes != self.total or self.trailer.xxh3_64 != self.digest.intdigest():
            raise KVTransferError("checksum mismatch: KV cache corrupted in transit")
        if self.total != self.size:
            raise KVTransferError("hand-off is missing chunks")
        return self.sink.close()
