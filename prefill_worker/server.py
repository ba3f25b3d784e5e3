"""The prefill worker process: the `PrefillWorker` service over the prefill model loop."""

import asyncio
import logging
import time

import grpc

from pdq.transport import kv_tcp, kv_transfer, mtls
from pdq.observability import metrics, telemetry, telemetry_grpc
from pdq.state.cancel_listener import CancelListener
from pdq.config import PrefillConfig
from pdq.ops.faults import Faults
from pdq.state.keys import Keys
from pdq.model.loader import eos_token_ids, resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.state.registry import WorkerInfo
from pdq.transport.serving import GRPC_OPTIONS, Server
from pdq.transport.status import StatusError
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from pdq.engine.runner import dtype_name
from pdq.engine.worker import Heartbeat, ModelThread, kv_info, load_runner, reclaim_previous_life, sync_store
from prefill_worker.loop import Job, Outcome, PrefillLoop

log = logging.getLogger("pdq.prefill")

PUSH_KV = "/pdq.v1.DecodeWorker/PushKV"


def _resolve(fut: asyncio.Future, outcome: Outcome) -> None:
    """A job's outcome for its call, unless the call went away (the scheduler cancelled it or
    died): the attempt then waits for its prefill lease to expire, and runs again elsewhere."""
    if not fut.done():
        fut.set_result(outcome)


class PrefillService(pb_grpc.PrefillWorkerServicer):
    def __init__(self, config: PrefillConfig):
        self.config = config
        self.loop: PrefillLoop | None = None
        self.faults = Faults.from_env()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = mtls.InternalTLS.from_config(config)
        self._tcp = kv_tcp.Pusher(self._tls)

    def _decode_stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        if address not in self._channels:
            self._channels[address] = mtls.aio_channel(address, self._tls, GRPC_OPTIONS,
                                                        interceptors=telemetry_grpc.client_interceptors())
        return pb_grpc.DecodeWorkerStub(self._channels[address])

    def _push_kv(self, address: str):
        """PushKV taking serialized KVChunk frames (`kv_transfer.encode_frames`): same wire bytes."""
        self._decode_stub(address)
        return self._channels[address].stream_unary(PUSH_KV, request_serializer=None,
                                                    response_deserializer=pb.PushKVResponse.FromString)

    async def Prefill(self, request: pb.PrefillBatch, context: grpc.aio.ServicerContext) -> pb.PrefillBatchResult:
        if self.loop is None or not self.loop.alive:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, "this prefill worker is not serving (its model loop is "
                              "not running: starting, stopping or failed); send the batch to another worker",
                              reason="WORKER_NOT_SERVING", retry_ms=1000)
        aio_loop = asyncio.get_running_loop()
        futures = []
        batch = telemetry.start("pdq.prefill_batch", links=[telemetry.span_context_of(it.spec.traceparent)
                                                             for it in request.items],
                                attributes={"pdq.batch_id": request.batch_id, "pdq.batch.size": len(request.items),
                                            "pdq.worker": self.config.name("prefill")})
        for item in request.items:
            fut: asyncio.Future[Outcome] = aio_loop.create_future()
            futures.append(fut)
            done = (lambda f: lambda outcome: aio_loop.call_soon_threadsafe(_resolve, f, outcome))(fut)
            span = None
            if batch is not None:  # per request, in the request's trace, linked to the batch
                span = telemetry.start("pdq.prefill", item.spec.traceparent, links=[batch.get_span_context()],
                                       attributes={**telemetry.request_attributes(item.spec),
                                                   "pdq.attempt": item.epoch, "pdq.batch_id": request.batch_id,
                                                   "pdq.worker": self.config.name("prefill")})
            self.loop.submit(Job(item, done, span=span, more_coming=request.more_coming))
        async def finish_all() -> list[pb.PrefillItemResult]:
            try:
                return await asyncio.gather(*(self._finish(item, fut) for item, fut in zip(request.items, futures)))
            finally:
                telemetry.end(batch)
        # Shielded: a scheduler that dies (or stops) with the batch under way cancels this call, but its
        # requests still get their hand-offs; only the answer is lost (failed items wait for their lease).
        task = asyncio.ensure_future(finish_all())
        task.add_done_callback(_log_unseen_error)
        return pb.PrefillBatchResult(results=await asyncio.shield(task))

    async def _finish(self, item: pb.PrefillItem, fut: asyncio.Future) -> pb.PrefillItemResult:
        outcome: Outcome = await fut
        rid = item.spec.request_id
        if outcome.kind == "error":
            return pb.PrefillItemResult(request_id=rid, ok=False, error=outcome.error,
                                        failure=pb.ATTEMPT_FAILURE_LOST if outcome.lost else pb.ATTEMPT_FAILURE_REQUEST)
        if outcome.kind == "local":
            return self._local(item, outcome)
        if outcome.kind != "handoff":  # finished at the first token, or ended elsewhere
            if outcome.kind == "finished" or outcome.kind == "dropped":
                await self._release(item)
            return pb.PrefillItemResult(request_id=rid, ok=True)
        tokens = len(item.spec.prompt_token_ids) + len(outcome.generated) - 1
        skip = item.decode_cached_tokens if item.decode_cached_tokens < tokens else 0
        error, code = await self._push(item, outcome, skip)
        if error and skip and code == grpc.StatusCode.DATA_LOSS and "PREFIX_MISSING" in error:
            metrics.KV_PREFIX_MISSES.inc()  # evicted there since its heartbeat: send the whole K/V
            error, code = await self._push(item, outcome, 0)
        if error:  # a decode worker that is down or not serving (restarting) lost the attempt; else it failed
            failure = pb.ATTEMPT_FAILURE_LOST if code == grpc.StatusCode.UNAVAILABLE else pb.ATTEMPT_FAILURE_HANDOFF
            return pb.PrefillItemResult(request_id=rid, ok=False, error=error, failure=failure)
        return pb.PrefillItemResult(request_id=rid, ok=True)

    async def _push(self, item: pb.PrefillItem, outcome: Outcome, skip: int) -> tuple[str | None, grpc.StatusCode]:
        """Sends the K/V of positions `skip`.. (the decode worker's prefix cache holds those before)
        to the request's decode worker. -> (error, its status code); (None, OK) when it took it."""
        rid = item.spec.request_id
        header = pb.KVHeader(spec=item.spec, epoch=item.epoch, generated_token_ids=outcome.generated, skip_tokens=skip)
        layers = [(k[:, skip:], v[:, skip:]) for k, v in outcome.layers] if skip else outcome.layers
        chunks = kv_transfer.encode_frames(header, layers, self.config.kv_chunk_bytes)
        transport = "tcp" if item.decode_kv_address else "grpc"  # the decode worker's data plane, or PushKV
        n_bytes = sum(t.numel() * t.element_size() for pair in layers for t in pair)
        n_chunks = kv_transfer.num_messages(layers, self.config.kv_chunk_bytes)
        span = telemetry.start("pdq.kv_transfer", item.spec.traceparent, kind=telemetry.SpanKind.CLIENT,
                               attributes={"pdq.request_id": rid, "pdq.attempt": item.epoch,
                                           "pdq.kv.bytes": n_bytes, "pdq.kv.chunks": n_chunks,
                                           "pdq.kv.layers": len(layers),
                                           "pdq.kv.tokens": len(item.spec.prompt_token_ids) + len(outcome.generated) - 1,
                                           "pdq.kv.skipped_tokens": skip,
                                           "server.address": item.decode_kv_address or item.decode_address,
                                           "pdq.kv.transport": transport})
        started = time.perf_counter()
        if self.faults:
            chunks = self.faults.kv_frames(chunks)
            if self.faults.get("kv_delay_ms"):
                await asyncio.sleep(self.faults.get("kv_delay_ms") / 1000)
        error, code = None, grpc.StatusCode.OK
        if transport == "tcp":
            try:
                await self._tcp.push(item.decode_kv_address, chunks, telemetry.traceparent(span) if span else "")
            except kv_tcp.Refused as exc:
                error, code = f"KV hand-off to {item.decode_kv_address}: {exc.code.name} {exc.details}", exc.code
        else:
            try:
                with telemetry.use(span):  # PushKV carries this span's context
                    resp = await self._push_kv(item.decode_address)(chunks, timeout=30.0)
                if not resp.accepted:
                    error, code = "decode worker refused the KV hand-off", grpc.StatusCode.FAILED_PRECONDITION
            except grpc.aio.AioRpcError as exc:
                error, code = f"KV hand-off to {item.decode_address}: {exc.code().name} {exc.details()}", exc.code()
        result = "ok" if error is None else "error"
        metrics.KV_TRANSFER.labels(result, transport).observe(time.perf_counter() - started)
        metrics.KV_TRANSFER_BYTES.labels(result, transport).inc(n_bytes)
        if error is None and skip:
            metrics.KV_SKIPPED_TOKENS.inc(skip)
        telemetry.end(span, "failed" if error else None, error)
        return error, code

    def _local(self, item: pb.PrefillItem, outcome: Outcome) -> pb.PrefillItemResult:
        """A colocated worker's hand-off to itself, done on the model thread
        (`DecodeService.adopt`): the decode role took the pool slot as it is (no bytes move),
        under the same reservation check as a hand-off from elsewhere. Reports it."""
        rid = item.spec.request_id
        tokens = len(item.spec.prompt_token_ids) + len(outcome.generated) - 1
        span = telemetry.start("pdq.kv_transfer", item.spec.traceparent, kind=telemetry.SpanKind.CLIENT,
                               attributes={"pdq.request_id": rid, "pdq.attempt": item.epoch, "pdq.kv.bytes": 0,
                                           "pdq.kv.tokens": tokens, "server.address": item.decode_address,
                                           "pdq.kv.transport": "local"})
        error = f"KV hand-off to {item.decode_address} (local): {outcome.error}" if outcome.error else ""
        metrics.KV_TRANSFER.labels("error" if error else "ok", "local").observe(0.0)
        telemetry.end(span, "failed" if error else None, error)
        return pb.PrefillItemResult(request_id=rid, ok=not error, error=error or "",
                                    failure=pb.ATTEMPT_FAILURE_HANDOFF if error else pb.ATTEMPT_FAILURE_UNSPECIFIED)

    async def _release(self, item: pb.PrefillItem) -> None:
        try:
            await self._decode_stub(item.decode_address).Release(
                pb.ReleaseRequest(request_id=item.spec.request_id, epoch=item.epoch), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("release of %s failed: %s", item.spec.request_id, exc.details())

    async def close(self) -> None:
        await self._tcp.close()
        for channel in self._channels.values():
            await channel.close()


def build_server(config: PrefillConfig) -> Server:
    """Builds the prefill worker; the model loads in `start` (health turns SERVING after)."""
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name],
                    mtls=mtls.InternalTLS.from_config(config))
    service = PrefillService(config)
    pb_grpc.add_PrefillWorkerServicer_to_server(service, server.grpc)
    keys = Keys(config.key_prefix)
    worker_id = config.name("prefill")
    address = config.advertise_address or f"{config.host}:{server.port}"
    state: dict = {}

    def info() -> WorkerInfo:
        runner = state.get("runner")
        return WorkerInfo(worker_id, "prefill", address, **kv_info(runner))

    async def start() -> None:
        path = await asyncio.to_thread(resolve_model, config.model)
        model = ModelThread("prefill-model")  # loads the model, then runs the loop (see ModelThread)
        runner = await model.run(load_runner, config, config.max_batched_tokens + config.max_seq_len * 4,
                                 (config.max_batched_tokens, config.prefill_chunk))
        state["runner"] = runner
        state["cancels"] = CancelListener(config.redis_url, keys, config.redis_outage_s)
        service.loop = PrefillLoop(runner, sync_store(config), state["cancels"], load_tokenizer(path),
                                   eos_token_ids(path), config.max_batched_tokens, config.prefill_chunk)
        service.loop.start(model)
        await reclaim_previous_life(service.loop.store, worker_id, config.max_attempts)
        # the model is loaded and warm and its loop runs: calls are served from now (pdq.transport.rpc_guard),
        # and then the worker enters the registry
        server.ready = True
        state["heartbeat"] = Heartbeat(config, keys, info, lambda: server.ready and service.loop.alive)
        await state["heartbeat"].start()
        log.info("prefill worker %s at %s (%s on %s, KV %d tokens in blocks of %d)", worker_id, address,
                 dtype_name(runner.dtype), runner.device.type, runner.capacity_tokens, runner.block_size)

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


def _log_unseen_error(task: asyncio.Future) -> None:
    """Logs a shielded batch's error: after its caller left, nobody else sees it."""
    if not task.cancelled() and task.exception() is not None:
        log.error("prefill batch failed: %r", task.exception())
