"""The scheduler through Redis outages, on a durable Redis killed and restarted: the janitor does
not take an outage for dead workers (nor does a scheduler that just started take old heartbeats
for them), yet reaps a worker that really died; Submit and Cancel answer UNAVAILABLE with a retry
hint while Redis is down past the outage window, and the loops carry on once it is back."""

import asyncio
import time

import grpc
import pytest
import redis.asyncio as aioredis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdq.ops.redis_server import RedisServer
from pdq.state.store import AsyncStore, now_ms
from pdq.v1 import internal_pb2 as pb
from tests.scheduler.fakes import wait_for
from tests.scheduler.harness import ended, harness, spec, token_indices

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def durable(tmp_path):
    server = RedisServer(directory=str(tmp_path), durable=True).start()
    yield server
    server.stop()


def kill(server: RedisServer) -> None:
    server.process.kill()  # no shutdown: what reached the AOF (appendfsync always) survives
    server.process.wait()


async def test_the_janitor_does_not_reap_workers_after_a_redis_outage_but_reaps_a_dead_one(durable, prefix):
    timeout = 2.0
    async with harness(durable.url, prefix, workers=dict(decode=2, slots=2, step_s=0.01),
                       worker_timeout_s=timeout) as h:
        await h.submit(spec("r", max_tokens=500))

        async def decoding():  # its decode worker steps it (the hand-off is over)
            rec = await h.store.record("r")
            return rec.get("state") == "DECODING" and int(rec.get("n_out", 0)) >= 3
        await wait_for(decoding)
        janitor = h.server.janitor
        fakes = [*h.workers.prefillers, *h.workers.decoders.values()]
        kill(durable)
        for w in fakes:  # silent until the janitor has read Redis again after it is back
            w.beating = False
        await asyncio.sleep(timeout * 1.5)  # Redis down longer than worker_timeout_s
        durable.start()
        n = janitor.reaps

        async def read_twice_since():  # every heartbeat it read since is older than worker_timeout_s
            return janitor.reaps >= n + 2
        await wait_for(read_twice_since, timeout_s=30)
        for w in fakes:
            w.beating = True

        async def observed_a_full_timeout():
            return janitor.watch.settled(time.monotonic())
        await wait_for(observed_a_full_timeout, timeout_s=30)
        m = janitor.reaps

        async def reaped_since():
            return janitor.reaps >= m + 2
        await wait_for(reaped_since, timeout_s=30)
        rec = await h.store.record("r")
        assert rec["epoch"] == "1" and "lost" not in rec and rec["state"] in ("DECODING", "COMPLETED")  # nothing requeued

        # a worker that really died is reaped: its request goes to the other decode worker
        victim = next((d for d in h.workers.decoders.values() if "r" in d.running), None)
        if victim is not None:
            await victim.kill()
        await ended(h, ["r"])
        rec = await h.store.record("r")
        assert rec.get("lost", "0") == ("1" if victim else "0") and "failures" not in rec
        assert await token_indices(h, "r") == list(range(500))


async def test_a_scheduler_that_just_started_waits_a_full_worker_timeout_before_reaping(redis_server, prefix):
    client = aioredis.Redis.from_url(redis_server.url)
    store = AsyncStore(client, prefix, 60)
    await store.submit(spec("r"))
    await store.claim([("r", "ghost")], "prefill-x", lease_ms=600_000)  # held by workers that died long ago
    long_ago = now_ms() - 600_000
    await client.zadd(store.keys.workers("decode"), {"ghost": long_ago})
    await client.zadd(store.keys.workers("prefill"), {"prefill-x": long_ago})
    before = time.monotonic()
    try:
        async with harness(redis_server.url, prefix, worker_timeout_s=1.5) as h:
            async def requeued():
                return (await h.store.record("r")).get("lost") == "1"
            await wait_for(requeued, timeout_s=30)
            assert time.monotonic() - before >= 1.5  # it saw them silent for worker_timeout_s itself
            assert await h.state("r") == "QUEUED" and "stopped heartbeating" in (await h.store.record("r"))["error"]
    finally:
        await client.aclose()


def retry_ms(err: grpc.aio.AioRpcError) -> int:
    status = rpc_status.from_call(err)
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds * 1000 + info.retry_delay.nanos // 1_000_000
    return 0


async def test_with_redis_down_submit_and_cancel_are_unavailable_with_a_retry_hint_and_the_loops_carry_on(
        durable, prefix):
    async with harness(durable.url, prefix, workers={}, redis_outage_s=1.0) as h:
        await h.submit(spec("before"))
        await ended(h, ["before"])
        kill(durable)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.submit(spec("during"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and retry_ms(err.value) > 0
        assert "Redis" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.Cancel(pb.InternalCancelRequest(request_id="before"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and retry_ms(err.value) > 0
        durable.start()
        await h.submit(spec("after"))  # the dispatcher and the janitor rode it out
        await ended(h, ["after"])
        assert await token_indices(h, "after") == [0, 1, 2, 3]
