"""The scheduler process: the internal `Scheduler` service, the dispatch loop and the janitor.

Everything it needs is in Redis, so a restarted scheduler resumes where the last one stopped.
Its RPCs never answer UNKNOWN or INTERNAL: they refuse bad input with INVALID_ARGUMENT, a full
queue with RESOURCE_EXHAUSTED, a reused request id with ALREADY_EXISTS, and (through
`pdq.transport.rpc_guard`) Redis unreachable past its outage window with UNAVAILABLE and a retry hint.
"""

import logging
import time

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pdq.observability import metrics, telemetry
from pdq.config import SchedulerConfig
from pdq.state.ending import Ending
from pdq.state import redisconn
from pdq.transport.mtls import InternalTLS
from pdq.transport.rpc_guard import status_of
from pdq.state.request import State
from pdq.transport.serving import Server
from pdq.transport.status import StatusError
from pdq.state.registry import live_workers
from pdq.state.calls import batched
from pdq.state.store import (AsyncStore, QueueLimits, RequestStore, RetryLimits, SubmitArgs, Submitted, TenantPolicy,
                             spec_from_bytes)
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.dispatcher import Dispatcher
from scheduler.janitor import Janitor
from scheduler.leader import Leadership
from scheduler.policies import ORDER_POLICIES, kv_misfit, resolve_tier, retry_after_ms

log = logging.getLogger("pdq.scheduler")

RETRY_PUSHBACK = "grpc-retry-pushback-ms"
POOLS_TTL_S = 2.0  # how stale the decode workers' KV pool sizes that Submit checks against may be
STATUS_DETAILS = "grpc-status-details-bin"


def queue_limits(config: SchedulerConfig, policy: TenantPolicy) -> QueueLimits:
    """The admission bounds for one tenant: its policy, else the scheduler's defaults."""
    return QueueLimits(config.max_queued, config.max_queued_tokens,
                       policy.max_queued or config.tenant_max_queued,
                       policy.max_queued_tokens or config.tenant_max_queued_tokens)


def retry_metadata(reason: str, message: str, delay_ms: int) -> tuple:
    """Trailing metadata of a RESOURCE_EXHAUSTED: the gRPC retry pushback and a
    `google.rpc.Status` carrying `ErrorInfo` (the reason) and `RetryInfo` (what grpcio-status
    clients read)."""
    info, retry = any_pb2.Any(), any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="pdq", metadata={"retry_after_ms": str(delay_ms)}))
    retry.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=delay_ms // 1000, nanos=(delay_ms % 1000) * 1_000_000)))
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message, details=[info, retry])
    return ((RETRY_PUSHBACK, str(delay_ms)), (STATUS_DETAILS, status.SerializeToString()))


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, store: AsyncStore, dispatcher: Dispatcher):
        self.config = config
        self.store = store
        self.dispatcher = dispatcher
        self.order = ORDER_POLICIES[config.order_policy]
        self._pools: list[int] = []  # each live decode worker's KV positions, as read at `_pools_at`
        self._pools_at = -POOLS_TTL_S

    async def decode_pools(self) -> list[int]:
        """Each live decode worker's KV pool (positions), read from the registry at most once per
        POOLS_TTL_S: a worker that joins or grows is seen within that. A failed read keeps the last."""
        now = time.monotonic()
        if now - self._pools_at >= POOLS_TTL_S:
            self._pools_at = now
            try:
                live = await live_workers(self.store, ("decode",), self.config.worker_timeout_s)
                self._pools = [w.kv_total_tokens for w in live["decode"] if w.kv_total_tokens]
            except Exception as exc:  # the submit goes on; the queue's own write says if Redis is down
                log.warning("could not read the decode workers' KV pools: %s", exc)
        return self._pools

    async def Submit(self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> pb.SubmitResponse:
        got = (await self.admit([request], in_call=True))[0]
        if isinstance(got, StatusError):
            raise got
        return got

    async def SubmitMany(self, request: pb.SubmitManyRequest,
                         context: grpc.aio.ServicerContext) -> pb.SubmitManyResponse:
        items = list(request.items)
        try:
            answers = await self.admit(items)
        except Exception as exc:
            if redisconn.unavailable(exc) or len(items) == 1:
                raise
            log.exception("a batch of %d submits failed; admitting each alone", len(items))
            answers = []
            for item in items:  # what one request carries must not fail the others
                try:
                    answers += await self.admit([item])
                except Exception as one:
                    if redisconn.unavailable(one):
                        raise
                    answers.append(status_of(one, "/pdq.v1.Scheduler/SubmitMany"))
        out = pb.SubmitManyResponse()
        for got in answers:
            if isinstance(got, StatusError):
                out.items.add(code=got.code.value[0], message=got.message,
                              trailing=[pb.MetadataEntry(key=k, value=v if isinstance(v, bytes) else v.encode())
                                        for k, v in got.trailing_metadata()])
            else:
                out.items.add(response=got)
        return out

    async def admit(self, requests: list[pb.SubmitRequest], in_call: bool = False
                    ) -> list[pb.SubmitResponse | StatusError]:
        """Validates and queues each request (Submit and SubmitMany): its answer, or the
        StatusError a Submit of its own ends with, in order. Their Redis writes are two round
        trips for all of them (the tenants' policies and arrival numbers, then the submits);
        only Redis unreachable (past its outage window) fails them all, raised. Each one's
        enqueue span is a child of the current span (`in_call`: the request's own Submit call),
        else of the request's trace context (its spec's traceparent)."""
        out: list[pb.SubmitResponse | StatusError | None] = [None] * len(requests)
        specs: dict[int, pb.RequestSpec] = {}
        for i, request in enumerate(requests):
            spec = pb.RequestSpec()
            spec.CopyFrom(request.spec)
            if not spec.request_id or not spec.tenant or not spec.prompt_token_ids:
                out[i] = StatusError(grpc.StatusCode.INVALID_ARGUMENT, "spec needs request_id, tenant and prompt_token_ids")
            else:
                specs[i] = spec
        read = await self.store.run(batched([RequestStore.policy_and_seq.build(self.store, specs[i].tenant)
                                             for i in specs])) if specs else []
        pools = await self.decode_pools() if specs else []
        wait = self.config.submit_wait_replicas
        queued: list[tuple[int, SubmitArgs]] = []
        for (i, spec), (policy, seq) in zip(specs.items(), read):
            tier = resolve_tier(spec.tier, policy.tier, self.config.tier_names)
            if tier is None:
                out[i] = StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"tier: must be one of {', '.join(self.config.tier_names)}, got {spec.tier!r}")
                continue
            spec.tier = tier
            misfit = kv_misfit(len(spec.prompt_token_ids), spec.sampling.max_tokens, pools)
            if misfit:
                out[i] = StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt: {misfit}",
                                     reason="PROMPT_EXCEEDS_KV_POOL", field="prompt")
                continue
            score = self.order(seq, len(spec.prompt_token_ids), spec.sampling.max_tokens, spec.deadline_ms)
            queued.append((i, SubmitArgs(spec, requests[i].idempotency_key, queue_limits(self.config, policy), seq,
                                         score)))
        if not queued:
            return out  # type: ignore[return-value]
        spans = [telemetry.start("pdq.enqueue", None if in_call else args.spec.traceparent or None,
                                 attributes={"pdq.request_id": args.spec.request_id, "pdq.tenant": args.spec.tenant,
                                             "pdq.tier": args.spec.tier, "pdq.seq": args.seq})
                 for _, args in queued]
        results = await self.store.submit_many([args for _, args in queued], wait, self.config.submit_wait_ms)
        created = []
        for (i, args), got, span in zip(queued, results, spans):
            out[i] = self._answer(args, got, span, wait)
            if got.kind == "created":
                created.append(args.spec)
        if created:
            if self.dispatcher.leader.leading:
                self.dispatcher.poke()
                for spec in created:
                    if spec.deadline_ms:
                        self.dispatcher.on_deadline(spec.deadline_ms)
            else:  # the leader hears of them on the queued channel (and sweeps their deadlines within a second)
                for spec in created:
                    await self.store.announce(spec.request_id)
        return out  # type: ignore[return-value]

    def _answer(self, args: SubmitArgs, got: Submitted, span, wait: int) -> pb.SubmitResponse | StatusError:
        """What one submit's write means for its caller (and its enqueue span's end)."""
        if got.kind == "conflict":
            used = args.idempotency_key or args.spec.request_id
            message = (f"request_id {used!r} was already used for a different request (another prompt, sampling "
                       f"or tier); use a new request_id for a new request")
            telemetry.end(span, "conflict", message)
            return StatusError(grpc.StatusCode.ALREADY_EXISTS, message, reason="REQUEST_ID_REUSED", field="request_id")
        if got.kind == "rejected":
            delay = retry_after_ms(got.drain_tokens, self.dispatcher.drain.rate(time.monotonic()),
                                   self.config.retry_after_min_ms, self.config.retry_after_max_ms)
            message = f"{got.reason}: {_explain(got.reason)}; retry in {delay} ms"
            telemetry.end(span, "rejected", message, event_attributes={"pdq.reason": got.reason, "pdq.retry_ms": delay})
            return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_metadata(got.reason, message, delay))
        telemetry.end(span, "idempotent_retry" if got.kind == "existing" else None,
                      attributes={"pdq.enqueue.result": got.kind})
        if 0 <= got.replicas < wait:
            message = (f"the request is queued on the Redis primary, but {got.replicas} of the {wait} replicas "
                       f"asked for confirmed it within {self.config.submit_wait_ms} ms, so a failover could lose "
                       f"it: retry with the same request_id (a retry never runs it twice)")
            return StatusError(grpc.StatusCode.UNAVAILABLE, message, reason="NOT_REPLICATED",
                               retry_ms=self.config.submit_wait_ms)
        return pb.SubmitResponse(request_id=got.request_id, created=got.kind == "created")

    async def Cancel(self, request: pb.InternalCancelRequest, context: grpc.aio.ServicerContext) -> pb.InternalCancelResponse:
        record = await self.store.record(request.request_id)
        if not record or (request.tenant and record.get("tenant") != request.tenant):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r}")
        state = await self.store.end(request.request_id, Ending.cancelled(request.reason or "client"))
        if state == State.CANCELLED and record.get("state") != State.CANCELLED.value:
            metrics.CANCELLATIONS.labels(metrics.cancel_source(request.reason)).inc()
        if telemetry.enabled() and record.get("spec"):  # in the request's trace, whoever cancels it
            caller = telemetry.current()
            span = telemetry.start("pdq.cancel", spec_from_bytes(record["spec"]).traceparent,
                                   links=[caller.get_span_context()] if caller else [],
                                   attributes={"pdq.request_id": request.request_id})
            telemetry.end(span, "cancelled", event_attributes={
                "pdq.reason": request.reason or "client", "pdq.state_before": record.get("state", ""),
                "pdq.state": state.value if state else ""})
        return pb.InternalCancelResponse(state=state.value if state else "")


def _explain(reason: str) -> str:
    return {"QUEUE_FULL": "the queue holds its maximum of requests",
            "QUEUE_TOKENS_FULL": "the queue holds its maximum of tokens",
            "TENANT_QUEUE_FULL": "this tenant has its maximum of requests queued",
            "TENANT_QUEUE_TOKENS_FULL": "this tenant has its maximum of tokens queued"}.get(reason, "queue full")


def build_server(config: SchedulerConfig) -> Server:
    """Builds (does not start) the scheduler: gRPC server, Redis store, its side of the election
    (`scheduler.leader`), and the dispatcher and janitor that run while it leads."""
    client = config.redis()
    store = AsyncStore(client, config.key_prefix, config.result_ttl_s, RetryLimits.of(config))

    def on_change(leading: bool) -> None:
        if leading:
            dispatcher.poke(queued=False)
            janitor.lead()
        else:
            dispatcher.stand_by()

    leader = Leadership(store, config.leader_id, config.leader_lease_s, on_change)
    dispatcher = Dispatcher(config, store, leader)
    janitor = Janitor(config, store, dispatcher.poke, leader)
    dispatcher.on_deadline = janitor.poke
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name],
                    mtls=InternalTLS.from_config(config))
    pb_grpc.add_SchedulerServicer_to_server(SchedulerService(config, store, dispatcher), server.grpc)

    async def start() -> None:
        await client.ping()
        load = await store.load()
        if load.get("n"):
            log.info("resuming: %d request(s) queued (%d tokens)", load["n"], load.get("tokens", 0))
        if not await leader.try_lead():
            log.info("scheduler %s on standby: %s leads", leader.id, leader.holder)
        leader.start()
        janitor.start()
        dispatcher.start()

    async def close() -> None:
        await janitor.stop()
        await dispatcher.stop()
        await leader.stop()  # resigns after its last round: a standby takes over at once
        await client.aclose()

    server.on_start.append(start)
    server.on_stop.append(close)
    server.dispatcher = dispatcher  # type: ignore[attr-defined]
    server.janitor = janitor  # type: ignore[attr-defined]
    server.leader = leader  # type: ignore[attr-defined]
    return server
