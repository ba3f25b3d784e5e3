"""The decode worker process: KV reservations and hand-offs in, the continuous batch out."""

import asyncio
import logging
import time

import grpc

from pdq import telemetry
from pdq.config import DecodeConfig
from pdq.keys import Keys
from pdq.kv_transfer import Assembler, KVTransferError
from pdq.model.loader import eos_token_ids, resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.registry import WorkerInfo
from pdq.serving import Server
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from pdq.worker import CancelListener, Heartbeat, load_runner, sync_store
from decode_worker.loop import DecodeLoop
from decode_worker.strategy import Strategy

log = logging.getLogger("pdq.decode")


class DecodeService(pb_grpc.DecodeWorkerServicer):
    """Owns the slot accounting: a request holds a slot from Reserve until its sequence leaves
    (or its reservation expires unused)."""

    def __init__(self, config: DecodeConfig):
        self.config = config
        self.loop: DecodeLoop | None = None
        self.capacity = 0
        self.holds: dict[str, float | None] = {}  # rid -> reservation expiry (monotonic), None once running
        self.expect: dict = {}
        self.on_change = lambda: None

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - len(self.holds))

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, expiry in list(self.holds.items()):
            if expiry is not None and expiry < now:
                log.warning("reservation of %s expired unused", rid)
                del self.holds[rid]

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        self._expire()
        rid = request.request_id
        granted = rid in self.holds or (self.loop is not None and self.free_slots > 0)
        if granted and rid not in self.holds:
            self.holds[rid] = time.monotonic() + self.config.reservation_timeout_s
            self.on_change()
        return pb.ReserveResponse(granted=granted, free_slots=self.free_slots)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        if self.holds.get(request.request_id, 0) is not None:  # reserved, not running: drop it
            self.holds.pop(request.request_id, None)
            self.on_change()
        return pb.ReleaseResponse()

    async def PushKV(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushKVResponse:
        asm = Assembler(self.expect)
        try:
            async for chunk in request_iterator:
                asm.add(chunk)
            kv = asm.finish()
        except KVTransferError as exc:
            rid = asm.header.spec.request_id if asm.header else "?"
            log.warning("rejected KV hand-off of %s: %s", rid, exc)
            telemetry.event("rejected", {"pdq.request_id": rid, "pdq.kv.bytes": asm.total}, error=str(exc))
            await context.abort(grpc.StatusCode.DATA_LOSS, f"KV hand-off rejected: {exc}")
        rid = kv.header.spec.request_id
        span = telemetry.current()
        if span is not None:
            span.set_attributes({"pdq.request_id": rid, "pdq.attempt": kv.header.epoch, "pdq.kv.bytes": asm.total,
                                 "pdq.kv.tokens": kv.header.num_tokens})
        if rid not in self.holds or self.holds[rid] is None:
            telemetry.event("rejected", error="no KV reservation (expired or released)")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no KV reservation for {rid} (expired or released)")
        self.holds[rid] = None
        assert self.loop is not None
        self.loop.add(kv)
        return pb.PushKVResponse(accepted=True)

    def left(self, rid: str) -> None:
        """A sequence left the batch (called on the event loop)."""
        self.holds.pop(rid, None)
        self.on_change()


def build_server(config: DecodeConfig) -> Server:
    """Builds the decode worker; the model loads in `start` (health turns SERVING after)."""
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name])
    service = DecodeService(config)
    pb_grpc.add_DecodeWorkerServicer_to_server(service, server.grpc)
    keys = Keys(config.key_prefix)
    worker_id = config.name("decode")
    address = config.advertise_address or f"{config.host}:{server.port}"
    state: dict = {}

    def info() -> WorkerInfo:
        running = len(service.loop.running) + len(service.loop.waiting) if service.loop else 0
        return WorkerInfo(worker_id, "decode", address, free_slots=service.free_slots,
                          capacity=service.capacity, running=running)

    async def start() -> None:
        path = await asyncio.to_thread(resolve_model, config.model)
        runner = await asyncio.to_thread(load_runner, config, config.kv_budget_tokens)
        aio_loop = asyncio.get_running_loop()
        service.capacity = min(runner.capacity, config.max_batch_size)
        service.expect = {"num_layers": runner.num_layers, "num_kv_heads": runner.num_kv_heads,
                          "head_dim": runner.head_dim, "dtype": str(runner.dtype).removeprefix("torch.")}
        state["cancels"] = CancelListener(config.redis_url, keys)
        service.loop = DecodeLoop(runner, sync_store(config), state["cancels"], load_tokenizer(path),
                                  eos_token_ids(path), address,
                                  lambda rid: aio_loop.call_soon_threadsafe(service.left, rid),
                                  Strategy(config.strategy, config.strategy_batch_size, config.dynamic_window_ms,
                                           config.static_flush_ms))
        service.loop.start()
        state["heartbeat"] = hb = Heartbeat(config, keys, info)
        service.on_change = hb.poke
        await hb.start()
        log.info("decode worker %s at %s (KV slots %d)", worker_id, address, service.capacity)

    async def stop() -> None:
        if "heartbeat" in state:
            await state["heartbeat"].stop()  # leaves the registry: no new reservations
        service.capacity = 0
        if service.loop:
            deadline = time.monotonic() + config.grace_s
            while service.loop.busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(service.loop.stop)
        if "cancels" in state:
            state["cancels"].close()

    server.on_start.append(start)
    server.on_stop.append(stop)
    return server
