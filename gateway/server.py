"""The gateway process: `pdq.v1.Generation` for clients. It validates, forwards to the
scheduler, and follows the request's output stream in Redis; it holds no queue state."""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from gateway.validation import Limits, build_spec, check_request
from pdq.config import GatewayConfig
from pdq.model.tokenizer import load_tokenizer
from pdq.request import FINISH_REASONS, STATUS_OF_STATE, State
from pdq.serving import GRPC_OPTIONS, Server, StatusError
from pdq.store import RequestStore, _str
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger("pdq.gateway")

DEFAULT_TENANT = "default"


class Event:
    """One entry of a request's output stream: a token, or the end."""

    __slots__ = ("index", "token_id", "text", "state", "reason", "error")

    def __init__(self, fields: dict):
        f = {_str(k): _str(v) for k, v in fields.items()}
        self.index = int(f["i"]) if "i" in f else None
        self.token_id = int(f.get("t", 0))
        self.text = f.get("x", "")
        self.state = State(f["done"]) if "done" in f else None
        self.reason = f.get("r", "")
        self.error = f.get("e", "")


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, store: RequestStore, scheduler: pb_grpc.SchedulerStub,
                 tokenizer, limits: Limits):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits

    # -- the request's life, shared by every RPC ------------------------------------------

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        return DEFAULT_TENANT

    async def submit(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext) -> str:
        """Validates and hands the request to the scheduler. -> request id."""
        check_request(request, self.limits)
        if request.prompt:
            prompt_ids = await asyncio.to_thread(lambda: self.tokenizer.encode(request.prompt, add_special_tokens=False).ids)
        else:
            prompt_ids = list(request.prompt_token_ids)
        now = int(time.time() * 1000)
        deadline = 0
        remaining = context.time_remaining()
        if remaining is not None:
            deadline = now + int(remaining * 1000)
        if request.timeout_ms:
            deadline = min(deadline or now + request.timeout_ms, now + request.timeout_ms)
        spec = build_spec(request, prompt_ids, self.tenant(context), uuid.uuid4().hex, now, deadline, self.limits)
        try:
            resp = await self.scheduler.Submit(pb.SubmitRequest(spec=spec, idempotency_key=request.request_id),
                                               timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise StatusError(exc.code(), exc.details()) from None
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"scheduler unreachable: {exc.details()}") from None
        return resp.request_id

    async def follow(self, rid: str) -> AsyncIterator[Event]:
        """Yields the output stream's entries from the start, until the end entry."""
        key = self.store.keys.output(rid)
        last = "0-0"
        while True:
            reply = await self.store.client.xread({key: last}, block=1000, count=256)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = _str(entry_id)
                    event = Event(fields)
                    yield event
                    if event.state is not None:
                        return

    async def final(self, rid: str, event: Event) -> tuple[gen_pb.Usage, gen_pb.Timings]:
        rec = await self.store.record(rid)
        created = float(rec.get("created_ms", 0))

        def since(name: str) -> float:
            value = rec.get(name)
            return float(value) - created if value else 0.0

        usage = gen_pb.Usage(prompt_tokens=int(rec.get("prompt_tokens", 0)), completion_tokens=int(rec.get("n_out", 0)))
        timings = gen_pb.Timings(queue_ms=since("dispatched_ms"), ttft_ms=since("first_token_ms"),
                                 e2e_ms=since("finished_ms"))
        return usage, timings

    async def cancel_on_exit(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        """The client went away (or its deadline passed) before the end: end the request too."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await self.store.finish(rid, State.TIMED_OUT, "timeout", "deadline exceeded")
            return
        try:
            await self.scheduler.Cancel(pb.InternalCancelRequest(request_id=rid, reason="client disconnected"),
                                        timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("cancel of %s after disconnect failed: %s", rid, exc.details())

    @staticmethod
    async def abort_for(event: Event, context: grpc.aio.ServicerContext) -> None:
        code = STATUS_OF_STATE[event.state]
        if code != grpc.StatusCode.OK:
            await context.abort(code, event.error or f"request {event.state.value.lower()}")

    # -- RPCs ------------------------------------------------------------------------------

    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext) -> gen_pb.GenerateResponse:
        rid = await self._submit_or_abort(request, context)
        text, ids, end = [], [], None
        try:
            async for event in self.follow(rid):
                if event.index is not None:
                    ids.append(event.token_id)
                    text.append(event.text)
                if event.state is not None:
                    end = event
        finally:
            if end is None:
                await asyncio.shield(self.cancel_on_exit(rid, context))
        await self.abort_for(end, context)
        usage, timings = await self.final(rid, end)
        return gen_pb.GenerateResponse(request_id=rid, text="".join(text), token_ids=ids,
                                       finish_reason=FINISH_REASONS.get(end.reason, 0), usage=usage, timings=timings)

    async def GenerateStream(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = await self._submit_or_abort(request, context)
        end = None
        try:
            yield gen_pb.GenerateStreamResponse(request_id=rid)
            async for event in self.follow(rid):
                if event.state is not None:
                    end = event
                    break
                yield gen_pb.GenerateStreamResponse(request_id=rid, index=event.index,
                                                    token_id=event.token_id, text=event.text)
        finally:
            if end is None:
                await asyncio.shield(self.cancel_on_exit(rid, context))
        await self.abort_for(end, context)
        usage, timings = await self.final(rid, end)
        yield gen_pb.GenerateStreamResponse(request_id=rid, finish_reason=FINISH_REASONS.get(end.reason, 0),
                                            usage=usage, timings=timings)

    async def Cancel(self, request: gen_pb.CancelRequest, context: grpc.aio.ServicerContext) -> gen_pb.CancelResponse:
        tenant = self.tenant(context)
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        mapped = await self.store.lookup_idempotent(tenant, rid)
        try:
            resp = await self.scheduler.Cancel(
                pb.InternalCancelRequest(request_id=mapped or rid, tenant=tenant, reason="client"), timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            code = exc.code() if exc.code() == grpc.StatusCode.NOT_FOUND else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, exc.details())
        return gen_pb.CancelResponse(state=resp.state)

    async def _submit_or_abort(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext) -> str:
        try:
            return await self.submit(request, context)
        except StatusError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises


def model_limits(config: GatewayConfig, model_dir: Path, tokenizer) -> Limits:
    cfg = json.loads((model_dir / "config.json").read_text())
    max_len = min(config.max_model_len, int(cfg.get("max_position_embeddings", config.max_model_len)))
    return Limits(max_model_len=max_len, vocab_size=int(cfg.get("vocab_size", tokenizer.get_vocab_size())),
                  default_max_tokens=config.default_max_tokens)


def build_server(config: GatewayConfig) -> Server:
    """Builds the gateway: public API on config.port, a channel to the scheduler, Redis for results."""
    from pdq.model.loader import resolve_model

    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    limits = model_limits(config, model_dir, tokenizer)
    client = aioredis.Redis.from_url(config.redis_url, decode_responses=False)
    store = RequestStore(client, config.key_prefix)
    channel = grpc.aio.insecure_channel(config.scheduler_address, options=GRPC_OPTIONS)
    service = GenerationService(config, store, pb_grpc.SchedulerStub(channel), tokenizer, limits)
    server = Server(config.host, config.port, [gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name])
    gen_grpc.add_GenerationServicer_to_server(service, server.grpc)

    async def start() -> None:
        await client.ping()

    async def stop() -> None:
        await channel.close()
        await client.aclose()

    server.on_start.append(start)
    server.on_stop.append(stop)
    return server
