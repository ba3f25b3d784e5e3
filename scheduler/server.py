"""The scheduler process: the internal `Scheduler` service plus the dispatch loop."""

import grpc
import redis.asyncio as aioredis

from pdq.config import SchedulerConfig
from pdq.request import State
from pdq.serving import Server
from pdq.store import RequestStore
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.dispatcher import Dispatcher


class SchedulerService(pb_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig, store: RequestStore, dispatcher: Dispatcher):
        self.config = config
        self.store = store
        self.dispatcher = dispatcher

    async def Submit(self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> pb.SubmitResponse:
        spec = request.spec
        if not spec.request_id or not spec.tenant or not spec.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "spec needs request_id, tenant and prompt_token_ids")
        kind, value = await self.store.submit(spec, request.idempotency_key, self.config.max_queued)
        if kind == "rejected":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{value}: {self.config.max_queued} requests are queued; retry later")
        self.dispatcher.wake.set()
        return pb.SubmitResponse(request_id=value, created=kind == "created")

    async def Cancel(self, request: pb.InternalCancelRequest, context: grpc.aio.ServicerContext) -> pb.InternalCancelResponse:
        record = await self.store.record(request.request_id)
        if not record or (request.tenant and record.get("tenant") != request.tenant):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r}")
        state = await self.store.finish(request.request_id, State.CANCELLED, "cancelled",
                                        f"cancelled by {request.reason or 'client'}")
        return pb.InternalCancelResponse(state=state.value if state else "")


def build_server(config: SchedulerConfig) -> Server:
    """Builds (does not start) the scheduler: gRPC server, Redis store, dispatcher."""
    client = aioredis.Redis.from_url(config.redis_url, decode_responses=False)
    store = RequestStore(client, config.key_prefix, config.result_ttl_s)
    dispatcher = Dispatcher(config, store)
    server = Server(config.host, config.port, [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name])
    pb_grpc.add_SchedulerServicer_to_server(SchedulerService(config, store, dispatcher), server.grpc)

    async def start() -> None:
        await client.ping()
        dispatcher.start()

    async def close() -> None:
        await dispatcher.stop()
        await client.aclose()

    server.on_start.append(start)
    server.on_stop.append(close)
    server.dispatcher = dispatcher  # type: ignore[attr-defined]
    return server
