"""Receiving a KV hand-off into the decode worker's KV pool.

The event loop thread (PushKV) takes the sequence's KV blocks when the header arrives, under a
key of its own (never the request id: a failed attempt's blocks may still be waiting to be freed
when the retry of the same request arrives): room for its prompt and every token it may still
generate, so a running sequence never waits for a block. The leading full blocks its prompt
shares with blocks this pool holds (an earlier hand-off of the same system prompt) are shared,
not copied: only the rest of the received K/V is written, so sequences with a common prefix hold
it once here too. A hand-off that left out the K/V of leading positions (`KVHeader.skip_tokens`:
the scheduler saw this worker's heartbeat name them) needs them among those shared blocks; when
they were evicted since, it is refused with PREFIX_MISSING (before any byte is written), and the
prefill worker sends the whole K/V. The chunks' bytes land in a staging
buffer, copied into the blocks once the stream checked out, while the model thread decodes
other sequences. Both outcomes go to the decode loop's inbox, so the blocks change hands only on
the model thread: `Arrived` (all checks passed: the blocks are renamed to the request id and the
sequence waits for admission) or `Discard` (anything failed: the blocks are freed).
"""

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdq.engine.blocks import KVPoolFull
from pdq.transport.kv_transfer import KVTransferError, scatter, sent_tokens, tensor_of
from pdq.v1 import internal_pb2 as pb
from pdq.engine.worker import kv_reserve_tokens

_receipts = itertools.count()


@dataclass
class Arrived:
    """A checked hand-off whose K/V fills positions [0, header.num_tokens) of the blocks held under `key`."""

    header: pb.KVHeader
    key: Any


@dataclass
class Discard:
    """Free the blocks held under `key` (on the model thread); `done` is resolved after."""

    key: Any
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class BlockSink:
    """A `kv_transfer.KVSink` receiving into fresh KV blocks. `admit(header)` runs first and
    may refuse the hand-off (no reservation) by raising."""

    def __init__(self, runner: Any, admit: Callable[[pb.KVHeader], None], output_grant: int = 0):
        self.runner = runner
        self.admit = admit
        self.output_grant = output_grant  # output positions granted up front (`kv_reserve_tokens`)
        self.key: Any = None  # set once blocks are held: they must then be discarded or arrive

    def open(self, header: pb.KVHeader) -> None:
        self.admit(header)
        if header.num_tokens > self.runner.max_seq_len:
            raise KVTransferError(f"{header.num_tokens} tokens exceed max_seq_len={self.runner.max_seq_len}")
        key = ("kv-in", header.spec.request_id, next(_receipts))
        tokens = list(header.spec.prompt_token_ids) + list(header.generated_token_ids[:-1])
        self.tokens = tokens if len(tokens) == header.num_tokens else None
        try:  # sharing the cached blocks that hold a prefix of its tokens (their K/V is not written again)
            self.cached = self.runner.allocate(key, self.tokens or (), max(
                header.num_tokens + 1, kv_reserve_tokens(header.spec, self.runner.max_seq_len, self.output_grant)))
        except KVPoolFull as exc:
            raise KVTransferError(str(exc)) from None
        self.key = key
        if self.cached < header.skip_tokens:
            raise KVTransferError(f"PREFIX_MISSING: the hand-off left out the K/V of {header.skip_tokens} leading "
                                  f"positions, this worker's prefix cache holds {self.cached} of them; send it whole")
        self.header = header
        self.dtype = self.runner.dtype
        self.itemsize = self.dtype.itemsize
        self.buf = torch.empty(header.num_layers, 2, header.num_kv_heads, sent_tokens(header), header.head_dim,
                               dtype=self.dtype)

    def write(self, offset: int, data: memoryview) -> None:
        scatter(self.header, offset // self.itemsize, tensor_of(data, self.dtype), self.buf)

    def close(self) -> Arrived:
        c, skipped = self.cached, self.header.skip_tokens  # the buffer holds positions skipped.. on
        self.runner.write_kv(self.key, self.buf[:, :, :, c - skipped:], self.tokens[c:] if self.tokens else None,
                             start=c)
        self.buf = None
        return Arrived(self.header, self.key)
