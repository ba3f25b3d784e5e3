"""A real scheduler in this process (gRPC on a loopback port, a private key prefix on the test
Redis) with fake workers, for fast integration tests of dispatch, leases and admission."""

import asyncio
import contextlib
from dataclasses import dataclass

import grpc

from pdq.state import redisconn
from pdq.config import SchedulerConfig
from pdq.state.store import AsyncStore
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.server import build_server
from tests.scheduler.fakes import FakeWorkers, wait_for

FAST = dict(dispatch_interval_ms=5, worker_timeout_s=1.0, prefill_lease_s=3.0, grace_s=1.0)


def spec(rid: str, tenant: str = "acme", tier: str = "", prompt: int = 4, max_tokens: int = 4,
         deadline_ms: int = 0, arrival_ms: int = 1) -> pb.RequestSpec:
    return pb.RequestSpec(request_id=rid, tenant=tenant, tier=tier, prompt_token_ids=[5] * prompt,
                          sampling=gen_pb.SamplingParams(max_tokens=max_tokens, seed=1), arrival_ms=arrival_ms,
                          deadline_ms=deadline_ms)


async def ended(h: "Harness", rids: list[str], states: tuple[str, ...] = ("COMPLETED",)) -> list[str]:
    """Waits until every one of `rids` is in one of `states`. -> their states."""
    async def all_ended():
        got = [await h.state(r) for r in rids]
        return got if all(s in states for s in got) else None
    return await wait_for(all_ended, timeout_s=30)


async def token_indices(h: "Harness", rid: str) -> list[int]:
    """The token indices of the request's output stream, in stream order."""
    entries = await h.store.client.xrange(h.store.keys.output(rid))
    return [int(f[b"i"]) for _, f in entries if b"i" in f]


@dataclass
class Harness:
    config: SchedulerConfig
    stub: pb_grpc.SchedulerStub
    store: AsyncStore
    server: object
    workers: FakeWorkers | None

    async def submit(self, s: pb.RequestSpec, key: str = "") -> pb.SubmitResponse:
        return await self.stub.Submit(pb.SubmitRequest(spec=s, idempotency_key=key), timeout=5)

    async def state(self, rid: str) -> str:
        return (await self.store.record(rid)).get("state", "")

    async def start_workers(self, **kw) -> FakeWorkers:
        self.workers = await FakeWorkers(self.config.redis_url, self.config.key_prefix, **kw).start()
        return self.workers


@contextlib.asynccontextmanager
async def harness(redis_url: str, prefix: str, workers: dict | None = None, **config):
    """Yields a Harness; `workers` (FakeWorkers options) starts fake workers first, None = none."""
    cfg = SchedulerConfig(redis_url=redis_url, key_prefix=prefix, port=0, **{**FAST, **config})
    client = redisconn.connect_async(redis_url)  # the test's reads ride through a Redis restart
    h = Harness(cfg, None, AsyncStore(client, prefix, 60), None, None)  # type: ignore[arg-type]
    if workers is not None:
        await h.start_workers(**workers)
    server = build_server(cfg)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    h.stub, h.server = pb_grpc.SchedulerStub(channel), server
    try:
        yield h
    finally:  # bounded, so that a stuck shutdown fails the test instead of hanging the run
        await asyncio.wait_for(server.stop(0.5), 15)
        await channel.close()
        if h.workers:
            await asyncio.wait_for(h.workers.stop(), 15)
        await client.aclose()
