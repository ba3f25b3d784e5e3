"""The gateway process: `pdq.v1.Generation` for clients, and `pdq.v1.Operator` for admins
(gateway.operator). It authenticates, validates, forwards to the scheduler, and follows the
request's output stream in Redis; it holds no queue state."""

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from pathlib import Path

import grpc

from gateway.auth import KeyRing, Principal
from gateway.errors import raise_resumable, resumable, rpc, scheduler_error
from gateway.follower import FollowerUnavailable, OutputFollower
from gateway.operator import OperatorService
from gateway.results import Collected, Event, follow, response, usage_and_timings
from gateway.schedulers import Schedulers
from gateway.validation import REQUEST_ID, Limits, build_spec, check_request, shown
from pdq.observability import metrics, telemetry
from pdq.transport import mtls
from pdq.config import GatewayConfig
from pdq.state.ending import Ending
from pdq.model.tokenizer import load_tokenizer
from pdq.state.request import FINISH_REASONS, STATUS_OF_STATE, State
from pdq.transport.serving import Server
from pdq.transport.status import StatusError
from pdq.state.store import AsyncStore, TenantPolicy
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import operator_pb2 as op_pb
from pdq.v1 import operator_pb2_grpc as op_grpc

log = logging.getLogger("pdq.gateway")

MAX_WAIT_MS = 60_000
INTERNAL_ID = re.compile(r"^[0-9a-f]{32}$")
# A client's own deadline fires before the gateway's copy of it (the gateway's starts when the
# call arrives), so a call that ends this close to its deadline ended because of it.
DEADLINE_SLACK_S = 0.5
# A unary Generate's stream interval unless it sets one: its decode worker writes its tokens to
# Redis every this many steps, and the gateway reads them as often (see stream_interval).
UNARY_STREAM_INTERVAL = 16
# A call to the scheduler may ride out a Redis outage there (redis_outage_s); it waits this much
# longer before the gateway calls the scheduler unreachable.
SCHEDULER_MARGIN_S = 5.0


class GenerationService(gen_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, store: AsyncStore, scheduler: Schedulers,
                 tokenizer, limits: Limits, keys: KeyRing):
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.keys = keys
        self.follower: OutputFollower | None = None  # set when the server starts (it needs a loop)
        self.stopping = False  # set when the gateway stops: calls it ends are not clients leaving

    # -- the request's life, shared by every RPC ------------------------------------------

    async def submit(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext,
                     principal: Principal, call_deadline: bool = True, interval: int = 1) -> tuple[str, bool]:
        """Validates and hands the request to the scheduler. -> (request id, created).
        interval: its stream interval unless the request sets one."""
        check_request(request, self.limits)
        if request.prompt:
            prompt_ids = await asyncio.to_thread(lambda: self.tokenizer.encode(request.prompt, add_special_tokens=False).ids)
        else:
            prompt_ids = list(request.prompt_token_ids)
        now = int(time.time() * 1000)
        deadline = 0
        remaining = context.time_remaining() if call_deadline else None
        if remaining is not None:
            deadline = now + int(remaining * 1000)
        if request.timeout_ms:
            deadline = min(deadline or now + request.timeout_ms, now + request.timeout_ms)
        spec = build_spec(request, prompt_ids, principal.tenant, uuid.uuid4().hex, now, deadline, self.limits,
                          interval)
        span = telemetry.current()
        if span is not None:  # later hops continue this span's trace, from Redis
            span.set_attributes({**telemetry.request_attributes(spec), "gen_ai.request.model": self.config.model,
                                 **telemetry.content_attributes(request.prompt)})
            spec.traceparent = telemetry.traceparent(span)
        try:
            resp = await self.scheduler.Submit(pb.SubmitRequest(spec=spec, idempotency_key=request.request_id),
                                               timeout=self.scheduler_timeout(context))
        except grpc.aio.AioRpcError as exc:
            raise scheduler_error(exc, "retry with the same request_id (a retry with it never runs the request "
                                       "twice)" if request.request_id else "retry (set request_id to make "
                                       "retries safe: without it a retry may run the request twice)") from None
        if span is not None:
            span.set_attribute("pdq.request_id", resp.request_id)
            if not resp.created:
                span.add_event("idempotent_retry", {"pdq.idempotency_key": request.request_id})
        return resp.request_id, resp.created

    async def submit_n(self, request: gen_pb.GenerateRequest, context, principal: Principal,
                       interval: int = 1) -> list[str]:
        """The request's n completions (`request.n`, 0 = 1), each a request of its own: choice i
        samples with the seed plus i and has the client request id "ID.i" (choice 0: ID itself).
        All or nothing: when one is refused, those accepted are cancelled and the refusal raised.
        The first goes first, so a prefill worker meets the rest with its prompt cached."""
        n = max(1, request.n)
        if n == 1:
            return [(await self.submit(request, context, principal, interval=interval))[0]]
        check_request(request, self.limits)  # a bad n (or any field) before choice 0 is in
        requests = []
        for i in range(n):
            one = gen_pb.GenerateRequest()
            one.CopyFrom(request)
            one.n = 0
            if i and one.request_id:
                one.request_id = f"{one.request_id}.{i}"
            if one.sampling.HasField("seed"):
                one.sampling.seed = (one.sampling.seed + i) % 2**64
            requests.append(one)
        rids = [(await self.submit(requests[0], context, principal, interval=interval))[0]]
        rest = await asyncio.gather(*(self.submit(r, context, principal, interval=interval) for r in requests[1:]),
                                    return_exceptions=True)
        failed = next((r for r in rest if isinstance(r, BaseException)), None)
        rids += [r[0] for r in rest if not isinstance(r, BaseException)]
        if failed is not None:
            await asyncio.gather(*(self.cancel(rid, "another choice of its request was refused") for rid in rids),
                                 return_exceptions=True)
            raise failed
        return rids

    async def resolve(self, principal: Principal, request_id: str) -> str:
        """The internal id of one of the caller's requests (by id or client request id)."""
        if not REQUEST_ID.match(request_id) and not INTERNAL_ID.match(request_id):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"request_id: must be 1..128 characters of A-Z a-z 0-9 . _ : -, got {shown(request_id)}",
                              reason="INVALID_FIELD", field="request_id")
        rid = await self.store.lookup_idempotent(principal.tenant, request_id) or request_id
        tenant = await self.store.client.hget(self.store.keys.request(rid), "tenant")
        if tenant is None or (tenant.decode() != principal.tenant and not principal.admin):
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no request {shown(request_id)}")
        return rid

    def scheduler_timeout(self, context: grpc.aio.ServicerContext | None) -> float:
        """How long a call to the scheduler may take: through a Redis outage it rides, within
        the client's own deadline."""
        timeout = self.config.redis_outage_s + SCHEDULER_MARGIN_S
        remaining = context.time_remaining() if context is not None else None
        return timeout if remaining is None else max(0.001, min(timeout, remaining))

    def client_left(self, exc: BaseException | None) -> bool:
        """Whether a call that ended before its request did ended because its client went away
        (it cancelled or closed the call, or its deadline passed: gRPC cancels the handler), as
        opposed to a failure of the gateway's own or the gateway stopping."""
        return isinstance(exc, (asyncio.CancelledError, GeneratorExit)) and not self.stopping

    async def cancel_on_exit(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        """The client went away (or its deadline passed) before the end: end the request too."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            if await self.store.end(rid, Ending.timed_out()) == State.TIMED_OUT:
                metrics.TIMEOUTS.labels("gateway").inc()
            return
        try:
            await self.scheduler.Cancel(pb.InternalCancelRequest(request_id=rid, reason="client disconnected"),
                                        timeout=self.scheduler_timeout(None))
        except grpc.aio.AioRpcError as exc:
            log.warning("cancel of %s after disconnect failed: %s", rid, exc.details())

    async def stream(self, rid: str, context: grpc.aio.ServicerContext, offset: int = 0, cancel_on_close: bool = True):
        """GenerateStreamResponse messages of a request from token `offset`, then its end: one
        message per output stream entry, i.e. the tokens a worker wrote at once (one, unless
        the request has a stream_interval), or per the entries at hand when this call fell
        behind the stream (`gateway.results.coalesce`)."""
        end = None
        sent = offset  # the first token index the client has not got
        left: BaseException | None = None  # what ended the call before the request ended
        span = telemetry.start("pdq.stream", attributes={"pdq.request_id": rid, "pdq.offset": offset})
        first = span is not None
        try:
            yield gen_pb.GenerateStreamResponse(request_id=rid)
            async for event in follow(self.store, self.follower, rid):
                if event.state is not None:
                    end = event
                    break
                skip = max(0, offset - event.index)
                if skip < len(event.token_ids):
                    if first:
                        span.add_event("first_token", {"pdq.token_index": event.index + skip})
                        first = False
                    yield gen_pb.GenerateStreamResponse(request_id=rid, index=event.index + skip,
                                                        token_id=event.token_ids[skip],
                                                        token_ids=event.token_ids[skip:],
                                                        text="".join(event.texts[skip:]),
                                                        logprobs=event.logprobs[skip:])
                    sent = event.index + len(event.token_ids)
            raise_for_end(end)
            usage, timings = await usage_and_timings(self.store, rid, end)
        except BaseException as exc:
            left = exc
            raise_resumable(exc, f"resume with StreamResult(request_id={rid!r}, offset={sent})")
            raise
        finally:
            if end is not None:
                telemetry.end(span, "end", event_attributes={"pdq.state": end.state.value})
            else:
                telemetry.end(span, "closed", f"stream closed before the request ended ({type(left).__name__})")
            if end is None and cancel_on_close and self.client_left(left):
                await asyncio.shield(self.cancel_on_exit(rid, context))
        note_usage(usage, end)
        yield gen_pb.GenerateStreamResponse(request_id=rid, finish_reason=FINISH_REASONS.get(end.reason, 0),
                                            usage=usage, timings=timings)

    async def streams(self, rids: list[str], context):
        """The messages of several requests' streams as they come, as (choice, message); a
        stream that fails yields (choice, its exception) and ends, the others go on. Closing
        this generator closes every stream (a client gone cancels every choice)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def follow(i: int, rid: str) -> None:
            try:
                async with contextlib.aclosing(self.stream(rid, context)) as messages:
                    async for msg in messages:
                        await queue.put((i, msg))
            except Exception as exc:
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.create_task(follow(i, rid)) for i, rid in enumerate(rids)]
        left = len(rids)
        try:
            while left:
                i, msg = await queue.get()
                if msg is None:
                    left -= 1
                else:
                    yield i, msg
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect_n(self, rids: list[str], context) -> list[gen_pb.GenerateResponse]:
        """Every choice's whole result; one failing fails the call (with its error) and cancels
        the others."""
        if len(rids) == 1:
            return [await self.collect(rids[0], context)]
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.collect(rid, context)) for rid in rids]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [t.result() for t in tasks]

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext) -> gen_pb.GenerateResponse:
        # nobody watches a unary call's tokens arrive: the worker may write them in groups
        rids = await self.submit_n(request, context, self.keys.authenticate(context), interval=UNARY_STREAM_INTERVAL)
        outs = await self.collect_n(rids, context)
        return outs[0] if len(outs) == 1 else merged(rids, outs)

    async def collect(self, rid: str, context: grpc.aio.ServicerContext) -> gen_pb.GenerateResponse:
        """A request's whole result, once it ended; the call ending first (its client gone)
        cancels the request."""
        got = Collected()
        left: BaseException | None = None
        span = telemetry.start("pdq.stream", attributes={"pdq.request_id": rid})
        try:
            async for event in follow(self.store, self.follower, rid):
                got.add(event)
            raise_for_end(got.end)
            out = await response(self.store, rid, got)
        except BaseException as exc:
            left = exc
            raise_resumable(exc, f"fetch its result with GetResult(request_id={rid!r}) or StreamResult")
            raise
        finally:
            if got.end is not None:
                telemetry.end(span, "end", event_attributes={"pdq.state": got.end.state.value})
            else:
                telemetry.end(span, "closed", f"call ended before the request ({type(left).__name__})")
            if got.end is None and self.client_left(left):
                await asyncio.shield(self.cancel_on_exit(rid, context))
        note_usage(out.usage, got.end)
        if telemetry.TRACE_CONTENT:
            telemetry.event("completion", telemetry.content_attributes(output=out.text))
        return out

    @rpc
    async def GenerateStream(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rids = await self.submit_n(request, context, self.keys.authenticate(context))
        if len(rids) == 1:
            async for msg in self.stream(rids[0], context):
                yield msg
            return
        async with contextlib.aclosing(self.streams(rids, context)) as messages:
            async for i, msg in messages:
                if isinstance(msg, Exception):  # a choice failed: the call ends with its error
                    raise msg
                msg.choice = i
                yield msg

    @rpc
    async def Submit(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext) -> gen_pb.SubmitResult:
        if request.n > 1:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"n: Submit takes one completion (n 0 or 1), got "
                              f"{request.n}: submit each choice as a request of its own (its own seed and request_id), "
                              "or use Generate / GenerateStream", reason="INVALID_FIELD", field="n")
        rid, created = await self.submit(request, context, self.keys.authenticate(context), call_deadline=False)
        return gen_pb.SubmitResult(request_id=rid, created=created)

    @rpc
    async def GetResult(self, request: gen_pb.GetResultRequest, context: grpc.aio.ServicerContext) -> gen_pb.GetResultResponse:
        if request.wait_ms > MAX_WAIT_MS:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"wait_ms: at most {MAX_WAIT_MS}, got {request.wait_ms}")
        rid = await self.resolve(self.keys.authenticate(context), request.request_id)
        got = Collected()
        try:
            async for event in follow(self.store, self.follower, rid, wait_ms=request.wait_ms):
                got.add(event)
        except FollowerUnavailable as exc:
            raise resumable(exc, f"call GetResult(request_id={rid!r}) again") from None
        rec = await self.store.record_fields(rid, ("state", "client_request_id"))
        out = gen_pb.GetResultResponse(request_id=rid, state=rec.get("state", ""), done=got.end is not None,
                                       result=await response(self.store, rid, got),
                                       client_request_id=rec.get("client_request_id", ""))
        if got.end is not None:
            out.error = got.end.error
        return out

    @rpc
    async def StreamResult(self, request: gen_pb.StreamResultRequest, context: grpc.aio.ServicerContext):
        rid = await self.resolve(self.keys.authenticate(context), request.request_id)
        async for msg in self.stream(rid, context, offset=request.offset, cancel_on_close=False):
            yield msg

    @rpc
    async def Cancel(self, request: gen_pb.CancelRequest, context: grpc.aio.ServicerContext) -> gen_pb.CancelResponse:
        rid = await self.resolve(self.keys.authenticate(context), request.request_id)
        return gen_pb.CancelResponse(state=await self.cancel(rid, "client", context))

    async def cancel(self, rid: str, reason: str, context: grpc.aio.ServicerContext | None = None) -> str:
        """Cancels a request through the scheduler (idempotent; workers drop it at their next
        step and free its KV). -> its state after the call."""
        try:
            resp = await self.scheduler.Cancel(pb.InternalCancelRequest(request_id=rid, reason=reason),
                                               timeout=self.scheduler_timeout(context))
        except grpc.aio.AioRpcError as exc:
            raise scheduler_error(exc, "retry (a cancel is idempotent)") from None
        return resp.state


def raise_for_end(end) -> None:
    """The call's status for a request's end (OK for COMPLETED)."""
    code = STATUS_OF_STATE[end.state]
    if code != grpc.StatusCode.OK:
        telemetry.event(end.state.value.lower(), {"pdq.reason": end.reason}, error=end.error or end.state.value)
        raise StatusError(code, end.error or f"request {end.state.value.lower()}")


def merged(rids: list[str], outs: list[gen_pb.GenerateResponse]) -> gen_pb.GenerateResponse:
    """n results as one response: choice 0's fields, every choice in `choices`, the usage of all."""
    out = gen_pb.GenerateResponse()
    out.CopyFrom(outs[0])
    for i, (rid, one) in enumerate(zip(rids, outs)):
        out.choices.add(index=i, request_id=rid, text=one.text, token_ids=one.token_ids,
                        finish_reason=one.finish_reason, logprobs=one.logprobs)
    out.usage.completion_tokens = sum(one.usage.completion_tokens for one in outs)
    return out


def note_usage(usage: gen_pb.Usage, end) -> None:
    """Puts the request's usage and finish reason on the call's span."""
    span = telemetry.current()
    if span is not None:
        span.set_attributes({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                             "gen_ai.usage.output_tokens": usage.completion_tokens,
                             "gen_ai.response.finish_reasons": [end.reason] if end is not None else []})


def model_limits(config: GatewayConfig, model_dir: Path, tokenizer) -> Limits:
    cfg = json.loads((model_dir / "config.json").read_text())
    max_len = min(config.max_model_len, int(cfg.get("max_position_embeddings", config.max_model_len)))
    return Limits(max_model_len=max_len, vocab_size=int(cfg.get("vocab_size", tokenizer.get_vocab_size())),
                  default_max_tokens=config.default_max_tokens, tiers=tuple(config.tier_names))


def build_server(config: GatewayConfig) -> Server:
    """Builds the gateway: public API on config.port, channels to the scheduler replicas, Redis for results."""
    from pdq.model.loader import resolve_model

    model_dir = resolve_model(config.model)
    tokenizer = load_tokenizer(model_dir)
    limits = model_limits(config, model_dir, tokenizer)
    keys = KeyRing.from_file(config.auth_file) if config.auth_file else KeyRing()
    if keys.open:
        log.warning("no --auth-file: running open, every caller is tenant 'default' with the admin role")
    client = config.redis()
    store = AsyncStore(client, config.key_prefix)
    schedulers = Schedulers(config.scheduler_addresses, mtls.InternalTLS.from_config(config))
    service = GenerationService(config, store, schedulers, tokenizer, limits, keys)
    server = Server(config.host, config.port, [gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name,
                                               op_pb.DESCRIPTOR.services_by_name["Operator"].full_name],
                    tls=(config.tls_cert, config.tls_key) if config.tls_cert else None)
    gen_grpc.add_GenerationServicer_to_server(service, server.grpc)
    op_grpc.add_OperatorServicer_to_server(OperatorService(config, store, service, keys), server.grpc)

    door = None
    if config.http_port:
        from gateway.http_api import OpenAIDoor
        from gateway.chat_request import ChatTemplate

        tok_config = model_dir / "tokenizer_config.json"
        template = ChatTemplate.from_config(json.loads(tok_config.read_text()) if tok_config.exists() else {})
        door = OpenAIDoor(service, config.served_model_name or config.model, template)

    async def start() -> None:
        await client.ping()
        service.follower = OutputFollower(config.redis_url, client, config.redis_outage_s, parse=Event)
        for tenant, policy in keys.tenants.items():  # the key file's tenant policies, for the scheduler
            await store.set_tenant_policy(tenant, TenantPolicy(**policy))
        if door is not None:
            await door.start(config.host, config.http_port, (config.tls_cert, config.tls_key) if config.tls_cert else None)

    async def stop() -> None:
        service.stopping = True  # calls ended from here on end UNAVAILABLE, their requests untouched
        if door is not None:
            await door.stop()
        if service.follower is not None:
            await service.follower.close()
        await schedulers.close()
        await client.aclose()

    server.on_start.append(start)
    server.on_stop.append(stop)
    return server
