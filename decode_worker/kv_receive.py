"""Receiving a KV hand-off straight into the decode worker's KV pool.

The event loop thread (PushKV) allocates a slot when the header arrives, under a key of its own
(never the request id: a failed attempt's slot may still be waiting to be freed when the retry
of the same request arrives), and writes each chunk's bytes into it while the model thread
decodes other sequences (`KVPool.pinned`). Only the model thread frees slots (a free moves
another slot's K/V), so both outcomes go to the decode loop's inbox: `Arrived` (all checks
passed: the slot is renamed to the request id and the sequence waits for admission) or
`Discard` (anything failed: the slot is freed and nothing is decoded).
"""

import concurrent.futures
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdq.engine.kv_pool import KVPoolFull
from pdq.kv_transfer import KVTransferError, scatter, tensor_of
from pdq.v1 import internal_pb2 as pb

_receipts = itertools.count()


@dataclass
class Arrived:
    """A checked hand-off whose K/V fills positions [0, header.num_tokens) of slot `key`."""

    header: pb.KVHeader
    key: Any


@dataclass
class Discard:
    """Free slot `key` (on the model thread); `done` is resolved after."""

    key: Any
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class SlotSink:
    """A `kv_transfer.KVSink` writing into a fresh pool slot. `admit(header)` runs first and
    may refuse the hand-off (no reservation) by raising."""

    def __init__(self, runner: Any, admit: Callable[[pb.KVHeader], None]):
        self.runner = runner
        self.admit = admit
        self.key: Any = None  # set once a slot is held: it must then be discarded or arrive

    def open(self, header: pb.KVHeader) -> None:
        self.admit(header)
        if header.num_tokens > self.runner.max_seq_len:
            raise KVTransferError(f"{header.num_tokens} tokens exceed max_seq_len={self.runner.max_seq_len}")
        key = ("kv-in", header.spec.request_id, next(_receipts))
        try:
            self.runner.allocate(key)
        except KVPoolFull as exc:
            raise KVTransferError(str(exc)) from None
        self.key = key
        self.runner.set_kv_length(key, header.num_tokens)  # before any write: a slot move keeps them
        self.header = header
        self.dtype = self.runner.dtype
        self.itemsize = self.dtype.itemsize

    def write(self, offset: int, data: memoryview) -> None:
        src = tensor_of(data, self.dtype)
        with self.runner.kv_slot(self.key) as kv:
            scatter(self.header, offset // self.itemsize, src, kv)

    def close(self) -> Arrived:
        return Arrived(self.header, self.key)
