"""`pdq.v1.Operator` on the gateway: see and control requests, tenants, queues and workers.

Every RPC needs an admin API key (UNAUTHENTICATED without a valid key, PERMISSION_DENIED for a
client key). Everything acts on Redis through `AsyncStore` and `pdq.state.registry`; a cancel goes
through the scheduler like `Generation.Cancel`, so workers drop the request at their next step.
"""

import dataclasses
import math
import re
from typing import TYPE_CHECKING

import grpc

from gateway.auth import KeyRing, Principal
from gateway.errors import rpc
from gateway.validation import MAX_TIMEOUT_MS, invalid, shown
from pdq.observability import metrics
from pdq.config import GatewayConfig
from pdq.state.ending import Ending
from pdq.state.registry import ROLES, WorkerInfo, live_workers, set_drained
from pdq.state.request import State
from pdq.transport.status import StatusError
from pdq.state.store import AsyncStore, TenantPolicy, now_ms
from pdq.v1 import operator_pb2 as op_pb
from pdq.v1 import operator_pb2_grpc as op_grpc

if TYPE_CHECKING:  # the service it cancels through; gateway.server builds both
    from gateway.server import GenerationService

NAME = re.compile(r"^[^\s\x00-\x1f]{1,128}$")  # tenant and worker names: 1..128 visible characters
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


def request_info(rec: dict) -> op_pb.RequestInfo:
    """A request record (RequestStore.record) as RequestInfo."""
    def n(name: str) -> int:
        try:
            return int(float(rec.get(name) or 0))
        except ValueError:
            return 0
    return op_pb.RequestInfo(
        request_id=rec.get("id", ""), tenant=rec.get("tenant", ""), tier=rec.get("tier", ""),
        state=rec.get("state", ""), prompt_tokens=n("prompt_tokens"), max_tokens=n("max_tokens"),
        output_tokens=n("n_out"), created_ms=n("created_ms"), deadline_ms=n("deadline_ms"),
        dispatched_ms=n("dispatched_ms"), first_token_ms=n("first_token_ms"), finished_ms=n("finished_ms"),
        prefill_worker=rec.get("prefill_worker", ""), decode_worker=rec.get("decode_worker", ""),
        attempts=n("attempts"), finish_reason=rec.get("finish_reason", ""), error=rec.get("error", ""),
        client_request_id=rec.get("client_request_id", ""), lost_attempts=n("lost"))


def worker_info(w: WorkerInfo) -> op_pb.WorkerInfo:
    """A registry entry as WorkerInfo; a quarantine that has ended is not shown."""
    quarantined = w.quarantined(now_ms())
    return op_pb.WorkerInfo(worker_id=w.worker_id, role=w.role, address=w.address, free_slots=w.free_slots,
                            capacity=w.capacity, running=w.running, draining=w.draining, heartbeat_ms=w.heartbeat_ms,
                            quarantined_until_ms=w.quarantined_until_ms if quarantined else 0,
                            quarantine_reason=w.quarantine_reason if quarantined else "",
                            kv_free_tokens=w.kv_free_tokens, kv_total_tokens=w.kv_total_tokens,
                            kv_block_size=w.kv_block_size, reserved=w.reserved)


def policy_pb(tenant: str, p: TenantPolicy) -> op_pb.TenantPolicy:
    return op_pb.TenantPolicy(tenant=tenant, weight=p.weight or 0.0, tier=p.tier or "", max_queued=p.max_queued or 0,
                              max_queued_tokens=p.max_queued_tokens or 0)


def check_name(field: str, value: str) -> str:
    if not NAME.match(value):
        raise invalid(field, f"must be 1..128 visible characters without spaces, got {shown(value)}")
    return value


def check_tier(field: str, value: str, tiers: list[str]) -> str:
    if value and value not in tiers:
        raise invalid(field, f"must be one of {', '.join(tiers)}, got {shown(value)}")
    return value


def check_policy(p: op_pb.TenantPolicy, tiers: list[str]) -> TenantPolicy:
    """A TenantPolicy message as the store's policy (0 / empty = the scheduler's default)."""
    check_name("tenant", p.tenant)
    if not math.isfinite(p.weight) or p.weight < 0:
        raise invalid("weight", f"must be > 0 (0 = default), got {p.weight}")
    check_tier("tier", p.tier, tiers)
    return TenantPolicy(weight=p.weight or None, tier=p.tier or None, max_queued=p.max_queued or None,
                        max_queued_tokens=p.max_queued_tokens or None)


class OperatorService(op_grpc.OperatorServicer):
    def __init__(self, config: GatewayConfig, store: AsyncStore, generation: "GenerationService", keys: KeyRing):
        self.config = config
        self.store = store
        self.generation = generation  # its request-id resolution and cancel path
        self.keys = keys

    def admin(self, context: grpc.aio.ServicerContext) -> Principal:
        principal = self.keys.authenticate(context)
        if not principal.admin:
            raise StatusError(grpc.StatusCode.PERMISSION_DENIED,
                              f"the Operator API needs an admin API key; this key is tenant "
                              f"{principal.tenant!r}'s {principal.role} key")
        return principal

    async def request(self, context: grpc.aio.ServicerContext, request_id: str) -> str:
        """Authorizes the admin and resolves a request id of any tenant (NOT_FOUND if unknown)."""
        return await self.generation.resolve(self.admin(context), request_id)

    async def workers(self) -> list[WorkerInfo]:
        live = await live_workers(self.store, ROLES, self.config.worker_timeout_s)
        return [w for role in ROLES for w in live[role]]

    # -- requests --------------------------------------------------------------------------

    @rpc
    async def CancelRequest(self, request: op_pb.OperatorCancelRequest, context) -> op_pb.OperatorCancelResponse:
        rid = await self.request(context, request.request_id)
        return op_pb.OperatorCancelResponse(state=await self.generation.cancel(rid, "operator"))

    @rpc
    async def CancelTenant(self, request: op_pb.CancelTenantRequest, context) -> op_pb.CancelTenantResponse:
        self.admin(context)
        tenant = check_name("tenant", request.tenant)
        n = await self.store.end_tenant(tenant, Ending.cancelled("operator"))
        metrics.CANCELLATIONS.labels("operator").inc(n)
        return op_pb.CancelTenantResponse(cancelled=n)

    @rpc
    async def SetDeadline(self, request: op_pb.SetDeadlineRequest, context) -> op_pb.RequestInfo:
        rid = await self.request(context, request.request_id)
        if not 1 <= request.timeout_ms <= MAX_TIMEOUT_MS:
            raise invalid("timeout_ms", f"must be in [1, {MAX_TIMEOUT_MS}] ms from now, got {request.timeout_ms}")
        state = await self.store.set_deadline(rid, now_ms() + request.timeout_ms)
        if state is None:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no request {shown(request.request_id)}")
        if state.terminal:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"request {rid} has ended ({state.value}); its deadline cannot move")
        return request_info(await self.store.record(rid))

    @rpc
    async def GetRequest(self, request: op_pb.GetRequestRequest, context) -> op_pb.RequestInfo:
        rid = await self.request(context, request.request_id)
        rec = await self.store.record(rid)
        if not rec:  # expired since it was resolved
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no request {shown(request.request_id)}")
        return request_info(rec)

    @rpc
    async def ListRequests(self, request: op_pb.ListRequestsRequest, context) -> op_pb.ListRequestsResponse:
        self.admin(context)
        if request.tenant:
            check_name("tenant", request.tenant)
        if request.state and request.state not in State.__members__:
            raise invalid("state", f"must be one of {', '.join(State.__members__)}, got {shown(request.state)}")
        check_tier("tier", request.tier, self.config.tier_names)
        if request.page_size > MAX_PAGE_SIZE:
            raise invalid("page_size", f"must be at most {MAX_PAGE_SIZE} (0 = {DEFAULT_PAGE_SIZE}), got {request.page_size}")
        if request.page_token and not request.page_token.isdigit():
            raise invalid("page_token", f"must be a next_page_token of an earlier response, got {shown(request.page_token)}")
        ids, cursor = await self.store.list_requests(request.tenant, request.state, request.tier,
                                                     request.page_size or DEFAULT_PAGE_SIZE, request.page_token)
        records = await self.store.records(ids)
        return op_pb.ListRequestsResponse(requests=[request_info(r) for r in records if r], next_page_token=cursor)

    # -- workers ---------------------------------------------------------------------------

    @rpc
    async def ListWorkers(self, request: op_pb.ListWorkersRequest, context) -> op_pb.ListWorkersResponse:
        self.admin(context)
        return op_pb.ListWorkersResponse(workers=[worker_info(w) for w in await self.workers()])

    async def drain(self, request: op_pb.DrainWorkerRequest, context, drained: bool) -> op_pb.WorkerInfo:
        self.admin(context)
        wid = check_name("worker_id", request.worker_id)
        info = next((w for w in await self.workers() if w.worker_id == wid), None)
        if info is None:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no live worker {shown(wid)} (see ListWorkers)")
        await set_drained(self.store.client, self.store.keys, wid, drained)
        return worker_info(dataclasses.replace(info, draining=drained))

    @rpc
    async def DrainWorker(self, request: op_pb.DrainWorkerRequest, context) -> op_pb.WorkerInfo:
        return await self.drain(request, context, True)

    @rpc
    async def UndrainWorker(self, request: op_pb.DrainWorkerRequest, context) -> op_pb.WorkerInfo:
        return await self.drain(request, context, False)

    # -- queues and tenants ----------------------------------------------------------------

    async def pause(self, request: op_pb.PauseQueueRequest, context, paused: bool) -> op_pb.PauseQueueResponse:
        self.admin(context)
        if not request.tier and not request.tenant:
            raise invalid("tier", "set a tier or a tenant (or both)")
        check_tier("tier", request.tier, self.config.tier_names)
        if request.tenant:
            check_name("tenant", request.tenant)
        await self.store.pause(request.tier, request.tenant, paused)  # the dispatcher's next poll sees it
        tiers, tenants = await self.store.paused()
        return op_pb.PauseQueueResponse(paused_tiers=tiers, paused_tenants=tenants)

    @rpc
    async def PauseQueue(self, request: op_pb.PauseQueueRequest, context) -> op_pb.PauseQueueResponse:
        return await self.pause(request, context, True)

    @rpc
    async def ResumeQueue(self, request: op_pb.PauseQueueRequest, context) -> op_pb.PauseQueueResponse:
        return await self.pause(request, context, False)

    @rpc
    async def SetTenantPolicy(self, request: op_pb.TenantPolicy, context) -> op_pb.TenantPolicy:
        self.admin(context)
        policy = check_policy(request, self.config.tier_names)
        await self.store.set_tenant_policy(request.tenant, policy)
        return policy_pb(request.tenant, await self.store.tenant_policy(request.tenant))

    @rpc
    async def ListTenants(self, request: op_pb.ListTenantsRequest, context) -> op_pb.ListTenantsResponse:
        self.admin(context)
        names = await self.store.tenants()
        return op_pb.ListTenantsResponse(tenants=[policy_pb(t, await self.store.tenant_policy(t)) for t in names])

    @rpc
    async def GetStats(self, request: op_pb.GetStatsRequest, context) -> op_pb.Stats:
        self.admin(context)
        depth = await self.store.depth(self.config.tier_names)
        load = await self.store.load()
        decode = [w for w in await self.workers() if w.role == "decode"]
        tiers, tenants = await self.store.paused()
        return op_pb.Stats(
            queues=[op_pb.QueueDepth(tier=tier, tenant=tenant, requests=n, tokens=tokens)
                    for tier, tenant, n, tokens in depth],
            running=max(0, load.get("running", 0)),
            kv_slots_used=sum(w.reserved for w in decode),
            kv_slots_total=sum(w.capacity for w in decode), paused_tiers=tiers, paused_tenants=tenants,
            kv_tokens_used=sum(max(0, w.kv_total_tokens - w.kv_free_tokens) for w in decode),
            kv_tokens_total=sum(w.kv_total_tokens for w in decode))
