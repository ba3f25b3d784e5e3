"""The prefill worker process: the `PrefillWorker` service over the prefill model loop."""

import asyncio
import logging

import grpc

from pdq import kv_transfer
from pdq.config import PrefillConfig
from pdq.faults import Faults
from pdq.keys import Keys
from pdq.model.loader import eos_token_ids, resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.registry import WorkerInfo
from pdq.serving import GRPC_OPTIONS, Server
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from pdq.worker import CancelListener, Heartbeat, load_runner, sync_store
from prefill_worker.loop import Job, Outcome, PrefillLoop

log = logging.getLogger("pdq.prefill")


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, config: PrefillConfig):
        self.config = config
        self.loop: PrefillLoop | None = None
        self.faults = Faults.from_env()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _decode_stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        return pb_grpc.DecodeWorkerStub(self._channels[address])

    async def Prefill(self, request: pb.PrefillBatch, context: grpc.aio.ServicerContext) -> pb.PrefillBatchResult:
        assert self.loop is not None
        aio_loop = asyncio.get_running_loop()
        futures = []
        for item in request.items:
            fut: asyncio.Future[Outcome] = aio_loop.create_future()
            futures.append(fut)
            done = (lambda f: lambda outcome: aio_loop.call_soon_threadsafe(f.set_result, outcome))(fut)
            self.loop.submit(Job(item, done))
        results = await asyncio.gather(*(self._finish(item, fut) for item, fut in zip(request.items, futures)))
        return pb.PrefillBatchResult(results=results)

    async def _finish(self, item: pb.PrefillItem, fut: asyncio.Future) -> pb.PrefillItemResult:
        outcome: Outcome = await fut
        rid = item.spec.request_id
        if outcome.kind == "error":
            return pb.PrefillItemResult(request_id=rid, ok=False, error=outcome.error)
        if outcome.kind != "handoff":  # finished at the first token, or ended elsewhere
            if outcome.kind == "finished" or outcome.kind == "dropped":
                await self._release(item)
            return pb.PrefillItemResult(request_id=rid, ok=True)
        header = pb.KVHeader(spec=item.spec, epoch=item.epoch, generated_token_ids=outcome.generated)
        chunks = kv_transfer.encode(header, outcome.layers, self.config.kv_chunk_bytes)
        if self.faults:
            chunks = self.faults.kv_chunks(chunks)
            if self.faults.get("kv_delay_ms"):
                await asyncio.sleep(self.faults.get("kv_delay_ms") / 1000)
        try:
            resp = await self._decode_stub(item.decode_address).PushKV(chunks, timeout=30.0)
        except grpc.aio.AioRpcError as exc:
            return pb.PrefillItemResult(request_id=rid, ok=False,
                                        error=f"KV hand-off to {item.decode_address}: {exc.code().name} {exc.details()}")
        if not resp.accepted:
            return pb.PrefillItemResult(request_id=rid, ok=False, error="decode worker refused the KV hand-off")
        return pb.PrefillItemResult(request_id=rid, ok=True)

    async def _release(self, item: pb.PrefillItem) -> None:
        try:
            await self._decode_stub(item.decode_address).Release(
                pb.ReleaseRequest(request_id=item.spec.request_id, epoch=item.epoch), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("release of %s failed: %s", item.spec.request_id, exc.details())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


def build_server(config: PrefillConfig) -> Server:
    """Builds the prefill worker; the model loads in `start` (health turns SERVING after)."""
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name])
    service = PrefillService(config)
    pb_grpc.add_PrefillWorkerServicer_to_server(service, server.grpc)
    keys = Keys(config.key_prefix)
    worker_id = config.name("prefill")
    address = config.advertise_address or f"{config.host}:{server.port}"
    state: dict = {}

    def info() -> WorkerInfo:
        runner = state.get("runner")
        return WorkerInfo(worker_id, "prefill", address,
                          free_slots=runner.num_free if runner else 0,
                          capacity=runner.capacity if runner else 0)

    async def start() -> None:
        path = await asyncio.to_thread(resolve_model, config.model)
        runner = await asyncio.to_thread(load_runner, config, config.max_batched_tokens + config.max_seq_len * 4)
        state["runner"] = runner
        state["cancels"] = CancelListener(config.redis_url, keys)
        service.loop = PrefillLoop(runner, sync_store(config), state["cancels"], load_tokenizer(path),
                                   eos_token_ids(path), config.max_batched_tokens, config.prefill_chunk)
        service.loop.start()
        state["heartbeat"] = Heartbeat(config, keys, info)
        await state["heartbeat"].start()
        log.info("prefill worker %s at %s (KV slots %d)", worker_id, address, runner.capacity)

    async def stop() -> None:
        if "heartbeat" in state:
            await state["heartbeat"].stop()
        if service.loop:
            await asyncio.to_thread(service.loop.stop)
        await service.close()
        if "cancels" in state:
            state["cancels"].close()

    server.on_start.append(start)
    server.on_stop.append(stop)
    return server
