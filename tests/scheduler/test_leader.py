"""Several schedulers on one Redis: one leads (dispatches and sweeps) under a fenced lease, the
others serve submits and take over when it stops or dies; a deposed leader's writes are refused."""

import asyncio
import contextlib

import grpc
import pytest

from pdq.state import redisconn
from pdq.config import SchedulerConfig
from pdq.state.store import Deposed, AsyncStore
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from scheduler.leader import Leadership
from scheduler.server import build_server
from tests.scheduler.fakes import FakeWorkers, wait_for
from tests.scheduler.harness import FAST, spec

pytestmark = pytest.mark.asyncio(loop_scope="session")

LEASE_S = 0.4


@pytest.fixture
def url(redis_server):
    return redis_server.url


@contextlib.asynccontextmanager
async def scheduler(url: str, prefix: str, name: str, lease_s: float = LEASE_S):
    """A scheduler replica `name` (its own gRPC port) -> (server, stub)."""
    server = build_server(SchedulerConfig(redis_url=url, key_prefix=prefix, port=0, scheduler_id=name,
                                          leader_lease_s=lease_s, **FAST))
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, pb_grpc.SchedulerStub(channel)
    finally:
        await asyncio.wait_for(server.stop(0.5), 15)
        await channel.close()


@contextlib.asynccontextmanager
async def store_and_workers(url: str, prefix: str):
    client = redisconn.connect_async(url)
    workers = await FakeWorkers(url, prefix).start()
    try:
        yield AsyncStore(client, prefix, 60), workers
    finally:
        await asyncio.wait_for(workers.stop(), 15)
        await client.aclose()


async def completed(store: AsyncStore, rid: str) -> bool:
    return (await store.record(rid)).get("state") == "COMPLETED"


def leads(server, alone_over=None):
    """An async predicate: `server` leads (and `alone_over` does not)."""
    async def leading() -> bool:
        return server.leader.leading and not (alone_over is not None and alone_over.leader.leading)
    return leading


async def test_one_scheduler_leads_and_a_submit_to_a_standby_is_dispatched_by_the_leader(url, prefix):
    async with store_and_workers(url, prefix) as (store, _), \
            scheduler(url, prefix, "a") as (a, _), scheduler(url, prefix, "b") as (b, stub_b):
        assert a.leader.leading and not b.leader.leading and b.leader.holder == "a"
        got = await stub_b.Submit(pb.SubmitRequest(spec=spec("r1")), timeout=5)
        assert got.created
        await wait_for(lambda: completed(store, "r1"), timeout_s=10)
        assert (await store.record("r1"))["attempts"] == "1"


async def test_a_stopping_leader_resigns_and_a_standby_takes_over_at_its_next_try(url, prefix):
    async with contextlib.AsyncExitStack() as stack:
        store, _ = await stack.enter_async_context(store_and_workers(url, prefix))
        first = scheduler(url, prefix, "a", lease_s=60.0)  # b would wait a minute for its lease to run out
        a, _ = await first.__aenter__()
        b, stub_b = await stack.enter_async_context(scheduler(url, prefix, "b"))
        assert a.leader.leading and not b.leader.leading
        await first.__aexit__(None, None, None)
        await wait_for(leads(b), timeout_s=10)  # at its next try (every LEASE_S / 4)
        await stub_b.Submit(pb.SubmitRequest(spec=spec("r1")), timeout=5)
        await wait_for(lambda: completed(store, "r1"), timeout_s=10)


async def test_a_leader_that_stops_renewing_is_replaced_and_its_writes_are_refused(url, prefix):
    """The leader is cut off (its renewals stop, as if paused or partitioned); the standby takes
    the lease when it runs out, and the old leader's next claim, carrying its epoch, changes
    nothing."""
    async with store_and_workers(url, prefix) as (store, _), \
            scheduler(url, prefix, "a") as (a, _), scheduler(url, prefix, "b") as (b, stub_b):
        old = a.leader.epoch
        a.leader._stopping.set()  # its renewals stop; it still believes it leads until the lease runs out
        await a.leader._task
        await wait_for(leads(b), timeout_s=5)
        assert b.leader.epoch == old + 1 and not a.leader.leading
        await stub_b.Submit(pb.SubmitRequest(spec=spec("r1")), timeout=5)
        await wait_for(lambda: completed(store, "r1"), timeout_s=10)
        await store.submit(spec("r2"))
        with pytest.raises(Deposed):
            await store.claim([("r2", "d")], "p", fence=old)
        with pytest.raises(Deposed):
            await store.reap_worker("d", 3, fence=old)
        assert (await store.record("r2")).get("lease_prefill") != "p"  # the refused claim wrote nothing


async def test_the_lease_is_one_holders_a_renewal_keeps_the_epoch_and_a_rival_waits(url, prefix):
    async with store_and_workers(url, prefix) as (store, _):
        a, b = Leadership(store, "a", 30.0), Leadership(store, "b", 30.0)
        assert await a.try_lead() and not await b.try_lead()
        first = a.epoch
        assert await a.try_lead() and a.epoch == first  # renewed under the same epoch
        assert b.holder == "a"
        assert await store.resign("a") and not await store.resign("a")
        assert await b.try_lead() and b.epoch == first + 1
        assert not await a.try_lead()  # a sees b holding it and stands by
        assert not a.leading and a.epoch == 0
