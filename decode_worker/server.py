"""The decode worker process: KV reservations and hand-offs in, the continuous batch out."""

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

import grpc

from pdq.transport import kv_tcp
from pdq.observability import telemetry
from pdq.state.cancel_listener import CancelListener
from pdq.config import DecodeConfig
from pdq.state.keys import Keys
from pdq.transport.kv_tcp import Refused
from pdq.transport.kv_transfer import Assembler, KVTransferError
from pdq.model.loader import eos_token_ids, resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.transport.mtls import InternalTLS
from pdq.state.registry import WorkerInfo
from pdq.transport.serving import Server
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from pdq.engine.runner import dtype_name
from pdq.engine.worker import Heartbeat, ModelThread, kv_grant_tokens, kv_info, load_runner, reclaim_previous_life, sync_store
from decode_worker.colocated import ColocatedLoop
from decode_worker.kv_receive import Arrived, Discard, BlockSink
from decode_worker.loop import DecodeLoop, PreemptAsk
from pdq.engine.batching import Strategy
from prefill_worker.loop import PrefillLoop
from prefill_worker.server import PrefillService

log = logging.getLogger("pdq.decode")


class NoReservation(Exception):
    """A hand-off for a request that holds no reservation here (FAILED_PRECONDITION)."""


PREEMPT_WAIT_S = 10.0  # longest a Preempt call waits for the model loop


class NotServing(NoReservation):
    """A hand-off while the model loop is not running: starting, stopping or dead (UNAVAILABLE)."""


class DecodeService(pb_grpc.DecodeWorkerServicer):
    """Owns the admission accounting. A request holds a seat (one of `capacity` sequences) from
    Reserve until its sequence leaves, or its reservation expires unused; and the KV blocks for
    its prompt plus max_tokens, counted here (`pending`) until the pool hands them out, when its
    K/V starts to arrive (or its prompt starts on this process's own prefill side)."""

    def __init__(self, config: DecodeConfig):
        self.config = config
        self.loop: DecodeLoop | None = None
        self.runner = None  # the model's runner, once loaded: its free KV blocks bound the grants
        self.capacity = 0  # seats: sequences held at once
        self.spare_blocks = 0  # blocks kept for prompts this process prefills for other decode workers
        self.holds: dict[str, float | None] = {}  # rid -> reservation expiry (monotonic), None once running
        self.pending: dict[str, int] = {}  # rid -> KV blocks granted, not yet taken from the pool
        self._sizes: deque[int] = deque(maxlen=64)  # blocks of the latest grants: what a request takes
        self.receiving: set[str] = set()  # rids whose hand-off is arriving: their reservation does not expire
        self.expect: dict = {}
        self.on_change = lambda: None  # a seat was freed: heartbeat now
        self.on_arrival = lambda: None  # a hand-off's blocks were cached: heartbeat soon (separate P/D)
        self.kv_address = ""  # the TCP data plane's host:port, when it runs
        # holds changes on the event loop, and on a colocated worker's model thread (adopt)
        self._lock = threading.Lock()

    def prefilling(self) -> bool:
        """Whether a request reserved here is being prefilled (its KV has not arrived yet).
        Called from the model thread."""
        return any(expiry is not None for expiry in list(self.holds.values()))

    def threads(self) -> int:
        """Torch threads for the next decode step (called from the model thread): all of
        burst_threads while no reserved request is being prefilled, else the base threads."""
        return self.config.threads if self.prefilling() or not self.config.burst_threads else self.config.burst_threads

    @property
    def serving(self) -> bool:
        """Whether the model loop runs (not starting, stopping or dead): only then is work taken."""
        return self.loop is not None and self.loop.alive

    @property
    def free_blocks(self) -> int:
        """KV blocks free for new grants: the pool's free blocks less those granted, not yet taken."""
        if self.runner is None:
            return 0
        return max(0, self.runner.free_blocks - self.promised_blocks() - self.spare_blocks)

    @property
    def free_slots(self) -> int:
        """Requests that fit now: free seats, and free blocks for as many requests of the size
        of the latest grants (a quarter of max_seq_len before any)."""
        seats = max(0, self.capacity - len(self.holds))
        if self.runner is None:
            return 0
        typical = (sum(self._sizes) / len(self._sizes) if self._sizes
                   else self.runner.blocks_for(max(1, self.config.max_seq_len // 4)))
        return min(seats, int(self.free_blocks // max(1.0, typical)))

    def promised_blocks(self) -> int:
        """Blocks granted to hand-offs that have not taken them yet (read from the model thread)."""
        while True:
            try:
                return sum(self.pending.values())
            except RuntimeError:  # changed during the sum (the event loop's thread): read again
                continue

    def grant_tokens(self, request: pb.ReserveRequest) -> int:
        """KV positions a reservation grants up front (`kv_grant_tokens`): the prompt and up to
        kv_output_grant_tokens of output; all of `tokens` when the prompt's share is not known."""
        if not request.prompt_tokens:
            return min(request.tokens, self.config.max_seq_len)
        return kv_grant_tokens(request.prompt_tokens, max(0, request.tokens - request.prompt_tokens),
                               self.config.max_seq_len, self.config.kv_output_grant_tokens)

    def taken(self, rid: str) -> None:
        """The pool handed out `rid`'s blocks (its K/V is arriving, or its prompt is being
        prefilled here): they no longer count as pending."""
        with self._lock:
            self.pending.pop(rid, None)

    def expire(self) -> None:
        """Drops reservations that got no hand-off within reservation_timeout_s."""
        now = time.monotonic()
        with self._lock:
            for rid, expiry in list(self.holds.items()):
                if expiry is not None and expiry < now and rid not in self.receiving:
                    log.warning("reservation of %s expired unused", rid)
                    del self.holds[rid]
                    self.pending.pop(rid, None)

    async def Reserve(self, request: pb.ReserveRequest, context: grpc.aio.ServicerContext) -> pb.ReserveResponse:
        return self._reserve([request])[0]

    async def ReserveMany(self, request: pb.ReserveManyRequest,
                          context: grpc.aio.ServicerContext) -> pb.ReserveManyResponse:
        return pb.ReserveManyResponse(items=self._reserve(request.items))

    def _reserve(self, requests) -> list[pb.ReserveResponse]:
        """Answers reservations in order: a seat while more than `keep_free` are free, and the
        KV blocks of `tokens` (prompt + max_tokens); one heartbeat for all they took."""
        self.expire()
        out, took = [], False
        expiry = time.monotonic() + self.config.reservation_timeout_s
        serving = self.serving
        with self._lock:
            for request in requests:
                rid = request.request_id
                blocks = self.runner.blocks_for(max(1, self.grant_tokens(request))) if serving else 0
                fresh = (serving and rid not in self.holds and self.capacity - len(self.holds) > request.keep_free
                         and blocks <= self.free_blocks)
                if fresh:
                    self.holds[rid] = expiry
                    self.pending[rid] = blocks
                    self._sizes.append(blocks)
                took |= fresh
                out.append(pb.ReserveResponse(granted=serving and rid in self.holds,
                                              free_slots=self.free_slots if serving else 0,
                                              kv_address=self.kv_address))
        if took:
            self.on_change()
        return out

    async def Preempt(self, request: pb.PreemptRequest, context: grpc.aio.ServicerContext) -> pb.PreemptResponse:
        """Has the model loop preempt one sequence of the given tiers (`DecodeLoop._preempt`),
        between two steps; its seat and blocks are free when this answers."""
        if not self.serving or not request.tiers:
            return pb.PreemptResponse()
        ask = PreemptAsk(tuple(request.tiers), request.reason or "preempted for a better tier")
        self.loop.add(ask)
        try:
            rid = await asyncio.wait_for(asyncio.wrap_future(ask.done), PREEMPT_WAIT_S)
        except asyncio.TimeoutError:  # the loop is stuck in a long step: it skips the ask if it has not begun it
            ask.done.cancel()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model loop did not get to the preemption "
                                                             f"within {PREEMPT_WAIT_S:.0f} s")
        return pb.PreemptResponse(request_id=rid)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        with self._lock:
            dropped = self.holds.get(request.request_id, 0) is not None  # reserved, not running
            if dropped:
                self.holds.pop(request.request_id, None)
                self.pending.pop(request.request_id, None)
        if dropped:
            self.on_change()
        return pb.ReleaseResponse()

    def _admit(self, header: pb.KVHeader) -> None:
        rid = header.spec.request_id
        if not self.serving:
            raise NotServing("this decode worker is not serving (its model loop is not running: starting, "
                             "stopping or failed)")
        if self.holds.get(rid, None) is None:  # none, or its sequence is already running here
            raise NoReservation(f"no KV reservation for {rid} (expired or released)")

    async def PushKV(self, request_iterator, context: grpc.aio.ServicerContext) -> pb.PushKVResponse:
        """Receives the hand-off straight into a KV slot (`decode_worker.kv_receive`); on any
        failure the slot is freed before the call fails, so a retry finds the pool as before."""
        try:
            await self.receive(request_iterator)  # serialized KVChunks (see add_service)
        except Refused as exc:
            await context.abort(exc.code, exc.details)
        return pb.PushKVResponse(accepted=True)

    async def receive_tcp(self, frames: AsyncIterator[bytes], traceparent: str) -> None:
        """A hand-off on the TCP data plane (`pdq.transport.kv_tcp`), in the request's trace."""
        span = telemetry.start("pdq.kv_receive", traceparent or None, kind=telemetry.SpanKind.SERVER)
        try:
            with telemetry.use(span):
                await self.receive(frames)
        except Refused as exc:
            telemetry.end(span, "rejected", exc.details)
            raise
        except BaseException as exc:
            telemetry.end(span, "broken", f"hand-off stream broke: {exc!r}")
            raise
        telemetry.end(span)

    async def receive(self, frames: AsyncIterator[bytes]) -> None:
        """One hand-off's frames into a KV slot; returns once the sequence is queued to join the
        batch. Raises Refused (FAILED_PRECONDITION: no reservation; DATA_LOSS: a bad cache)
        after freeing the slot; a broken stream frees it too."""
        receiving = []

        def start(header: pb.KVHeader) -> None:
            """The header arrived: the reservation must exist, and now holds until the hand-off
            ends (a slow transfer must not lose its room to another request midway)."""
            self._admit(header)
            receiving.append(header.spec.request_id)
            self.receiving.add(header.spec.request_id)
            self.taken(header.spec.request_id)  # the sink takes its blocks next

        sink = BlockSink(self.loop.runner if self.loop else None, start, self.config.kv_output_grant_tokens)
        asm = Assembler(self.expect, sink)
        try:
            await self._receive(frames, sink, asm)
        finally:
            self.receiving.difference_update(receiving)

    async def _receive(self, frames: AsyncIterator[bytes], sink: BlockSink, asm: Assembler) -> None:
        try:
            async for frame in frames:
                asm.add_frame(frame)
            arrived = asm.finish()
            self._admit(arrived.header)  # the reservation may have expired meanwhile
        except (KVTransferError, NoReservation) as exc:
            await self._discard(sink)
            rid = asm.header.spec.request_id if asm.header else "?"
            if isinstance(exc, NoReservation):
                telemetry.event("rejected", error=str(exc))
                code = grpc.StatusCode.UNAVAILABLE if isinstance(exc, NotServing) else grpc.StatusCode.FAILED_PRECONDITION
                raise Refused(code, str(exc)) from None
            log.warning("rejected KV hand-off of %s: %s", rid, exc)
            telemetry.event("rejected", {"pdq.request_id": rid, "pdq.kv.bytes": asm.total}, error=str(exc))
            raise Refused(grpc.StatusCode.DATA_LOSS, f"KV hand-off rejected: {exc}") from None
        except BaseException:  # the stream broke, the call was cancelled, or a frame was malformed
            if sink.key is not None and self.loop is not None:
                self.loop.add(Discard(sink.key))
            raise
        h = arrived.header
        span = telemetry.current()
        if span is not None:
            span.set_attributes({"pdq.request_id": h.spec.request_id, "pdq.attempt": h.epoch,
                                 "pdq.kv.bytes": asm.total, "pdq.kv.tokens": h.num_tokens})
        with self._lock:
            self.holds[h.spec.request_id] = None
        self.loop.add(arrived)
        self.on_arrival()  # its blocks are cached here now: the heartbeat names them to the scheduler

    async def _discard(self, sink: BlockSink) -> None:
        """Frees the blocks a failed hand-off was written into (on the model thread) and waits for it."""
        if sink.key is None or self.loop is None:
            return
        item = Discard(sink.key)
        self.loop.add(item)
        try:
            await asyncio.wait_for(asyncio.wrap_future(item.done), timeout=10.0)
        except asyncio.TimeoutError:
            log.warning("KV blocks of a failed hand-off not freed within 10 s (decode loop stopped?)")

    def adopt(self, header: pb.KVHeader, key: object, moved: bool | None = None) -> str | None:
        """A hand-off from the prefill role of this process (colocated): the K/V is already in
        the shared pool under `key`. Runs on the model thread, right after the pass that
        completed the prompt: the sequence is added to the decode loop's waiting list at once,
        so the next pass decodes it, as one engine would (through the event loop it missed
        that pass). `moved`: whether the prefill side already moved the request to DECODING
        (None: this does). -> None once it waits to join the batch, else why not (the blocks
        are freed)."""
        with self._lock:
            try:
                self._admit(header)
            except NoReservation as exc:
                error = str(exc)
            else:
                error = None
                self.holds[header.spec.request_id] = None
        if error is not None:
            if self.loop is not None:
                self.loop.runner.free(key)
            return error
        self.loop.arrive(Arrived(header, key), moved)
        return None

    def left(self, rids: list[str]) -> None:
        """Sequences left the batch (called on the event loop)."""
        with self._lock:
            for rid in rids:
                self.holds.pop(rid, None)
                self.pending.pop(rid, None)
        self.on_change()


def add_service(server: grpc.aio.Server, service: DecodeService) -> None:
    """The generated registration, except that PushKV gets the serialized KVChunks: the hand-off
    is read straight from the received bytes (`Assembler.add_frame`), not via protobuf objects."""

    class Capture:
        handlers: dict = {}

        def add_generic_rpc_handlers(self, handlers: tuple) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            Capture.handlers = dict(handlers)

    pb_grpc.add_DecodeWorkerServicer_to_server(service, Capture())
    handlers = Capture.handlers
    handlers["PushKV"] = grpc.stream_unary_rpc_method_handler(
        service.PushKV, request_deserializer=None, response_serializer=pb.PushKVResponse.SerializeToString)
    name = pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


# A colocated worker's pool holds this many max_seq_len sequences more than its decode budget: room
# for prompts whose decode worker is another process (a local one prefills into its reserved blocks).
COLOCATED_EXTRA_SLOTS = 4


def build_server(config: DecodeConfig) -> Server:
    """Builds the decode worker (with `colocate`, also the prefill worker, over one model loop:
    `decode_worker.colocated`); the model loads in `start` (health turns SERVING after)."""
    names = [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name]
    if config.colocate:
        names.append(pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name)
    server = Server(config.host, config.port, names, mtls=InternalTLS.from_config(config))
    service = DecodeService(config)
    server.service = service  # for tests that look at the worker's pool
    add_service(server.grpc, service)
    prefill_config = config.prefill_config() if config.colocate else None
    prefill = PrefillService(prefill_config) if prefill_config else None
    if prefill is not None:
        pb_grpc.add_PrefillWorkerServicer_to_server(prefill, server.grpc)
    keys = Keys(config.key_prefix)
    worker_id = config.name("decode")
    address = config.advertise_address or f"{config.host}:{server.port}"
    state: dict = {}

    def info() -> WorkerInfo:
        service.expire()  # every heartbeat: an orphaned hold frees its seat even if no Reserve comes
        running = len(service.loop.running) + len(service.loop.waiting) if service.loop else 0
        return WorkerInfo(worker_id, "decode", address, free_slots=service.free_slots,
                          capacity=service.capacity, running=running, reserved=len(service.holds),
                          # what its prefix cache holds: colocated, the prefill role reports it; separate, the
                          # scheduler tells prefill workers which prefix a hand-off here may leave out
                          **kv_info(state.get("runner"), prefixes=prefill is None,
                                    kept_tokens=service.spare_blocks * service.runner.block_size if service.runner else 0))

    def prefill_info() -> WorkerInfo:
        runner = state.get("runner")
        return WorkerInfo(prefill_config.name("prefill"), "prefill", address, **kv_info(runner))

    async def start() -> None:
        path = await asyncio.to_thread(resolve_model, config.model)
        extra = COLOCATED_EXTRA_SLOTS * config.max_seq_len if config.colocate else 0
        model = ModelThread("model")  # loads the model, then runs the loop (see ModelThread)
        warm_up = ((config.step_tokens, config.prefill_chunk) if config.colocate else (config.max_batch_size, 1)) \
            + (config.max_batch_size,)  # and the GEMMs of every decode batch size
        runner = state["runner"] = await model.run(load_runner, config, config.kv_budget_tokens + extra, warm_up)
        aio_loop = asyncio.get_running_loop()
        strategy = Strategy(config.strategy, config.strategy_batch_size, config.dynamic_window_ms,
                            config.static_flush_ms, config.strategy_bucket)
        # A request-level batch holds every seat until its last sequence ends, and the next batch
        # is only taken (reserved, then prefilled) after that, as naive servers run: the wait
        # shows up in TTFT, where their users see it.
        service.capacity = min(config.max_batch_size,
                               strategy.batch_size if strategy.run_to_completion else config.max_batch_size)
        service.spare_blocks = runner.blocks_for(extra)
        service.runner = runner
        service.expect = {"num_layers": runner.num_layers, "num_kv_heads": runner.num_kv_heads,
                          "head_dim": runner.head_dim, "dtype": dtype_name(runner.dtype)}
        if config.kv_transport == "tcp":
            state["kv"] = kv = await kv_tcp.serve(config.host, config.kv_port, service.receive_tcp,
                                                  InternalTLS.from_config(config))
            service.kv_address = kv_tcp.join_address(kv_tcp.split_address(address)[0], kv.sockets[0].getsockname()[1])
        state["cancels"] = cancels = CancelListener(config.redis_url, keys, config.redis_outage_s)
        store, tokenizer, eos = sync_store(config), load_tokenizer(path), eos_token_ids(path)
        alone = not config.colocate  # the thread and pacing knobs are for sharing cores with a prefill process
        service.loop = DecodeLoop(runner, store, cancels, tokenizer, eos, address,
                                  lambda rids: aio_loop.call_soon_threadsafe(service.left, rids), strategy,
                                  service.threads if alone and config.burst_threads and config.threads else None,
                                  config.max_attempts, service.prefilling, config.yield_to_prefill_ms if alone else 0.0,
                                  tuple(config.tier_names), service.promised_blocks)
        model_loop = state["model"] = service.loop
        if prefill is not None:
            prefill.loop = PrefillLoop(runner, store, cancels, tokenizer, eos, config.step_tokens, config.prefill_chunk,
                                       local=lambda item: item.decode_address == address, adopt=service.adopt,
                                       taken=service.taken)
            prefill.loop.output_grant = config.kv_output_grant_tokens
            model_loop = state["model"] = ColocatedLoop(prefill.loop, service.loop, config.step_tokens, config.gather_ms)
        model_loop.start(model)
        await reclaim_previous_life(store, worker_id, config.max_attempts)
        if prefill is not None:
            await reclaim_previous_life(store, prefill_config.name("prefill"), config.max_attempts)
        # the model is loaded and warm and its loop runs: calls are served from now (pdq.transport.rpc_guard),
        # and then the worker enters the registry
        server.ready = True
        alive = lambda: server.ready and model_loop.alive  # noqa: E731
        state["heartbeat"] = hb = Heartbeat(config, keys, info, alive)
        service.on_change = hb.poke
        if prefill is None:  # the prefixes it reports let hand-offs to it leave them out
            service.on_arrival = hb.nudge
        await hb.start()
        if prefill is not None:
            state["prefill_heartbeat"] = Heartbeat(prefill_config, keys, prefill_info, alive)
            await state["prefill_heartbeat"].start()
        log.info("%s worker %s at %s (%s on %s, %d sequences, KV %d tokens in blocks of %d%s)",
                 "colocated prefill+decode" if prefill else "decode", worker_id, address,
                 service.expect["dtype"], runner.device.type, service.capacity, runner.capacity_tokens - extra,
                 runner.block_size,
                 f", KV data plane at {service.kv_address}" if service.kv_address else "")

    async def stop() -> None:
        for name in ("prefill_heartbeat", "heartbeat"):
            if name in state:
                await state[name].stop()  # leaves the registry: no new work
        service.capacity = 0
        if "model" in state:
            deadline = time.monotonic() + config.grace_s
            while state["model"].alive and state["model"].busy and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(state["model"].stop)
        if prefill is not None:
            await prefill.close()
        if "kv" in state:
            state["kv"].close()
        if "cancels" in state:
            state["cancels"].close()

    server.on_start.append(start)
    server.on_stop.append(stop)
    return server
