"""Crash recovery: a scheduler killed mid-load (a real `python -m scheduler` process, SIGKILL)
and restarted loses no request; a durable Redis (AOF, appendfsync always) killed and restarted
loses no accepted request."""

import os
import subprocess
import sys

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.ops.child import spawn
from pdq.ops.redis_server import RedisServer, free_port
from pdq.state.store import SyncStore
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from tests.scheduler.fakes import FakeWorkers, wait_for
from tests.scheduler.harness import spec


def start_scheduler(redis_url: str, prefix: str, port: int, log) -> subprocess.Popen:
    env = dict(os.environ, PDQ_REDIS_URL=redis_url, PDQ_KEY_PREFIX=prefix, PDQ_DISPATCH_INTERVAL_MS="5",
               PDQ_WORKER_TIMEOUT_S="3", PDQ_PREFILL_LEASE_S="2", PDQ_METRICS_PORT="-1")
    return spawn([sys.executable, "-m", "scheduler", "--host", "127.0.0.1", "--port", str(port)], env=env,
                 stdout=log, stderr=log)


async def wait_serving(port: int, proc: subprocess.Popen) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def serving():
            assert proc.poll() is None, "scheduler exited"
            try:
                return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)).status == 1
            except grpc.aio.AioRpcError:
                return False
        await wait_for(serving, timeout_s=30, every_s=0.05)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_scheduler_killed_mid_load_and_restarted_loses_nothing(redis_server, prefix, tmp_path):
    workers = await FakeWorkers(redis_server.url, prefix, decode=2, slots=3, step_s=0.01).start()
    store = workers.store
    port = free_port()
    log = open(tmp_path / "scheduler.log", "w")
    proc = start_scheduler(redis_server.url, prefix, port, log)
    try:
        await wait_serving(port, proc)
        rids = [f"r{k}" for k in range(30)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            for rid in rids:
                await stub.Submit(pb.SubmitRequest(spec=spec(rid, max_tokens=20)), timeout=5)

        async def states():
            return [(await store.record(r)).get("state", "?") for r in rids]

        async def some_done():
            return (await states()).count("COMPLETED") >= 5
        await wait_for(some_done, timeout_s=30)
        proc.kill()
        proc.wait()
        before = await states()
        assert "QUEUED" in before and "COMPLETED" in before  # killed mid-load
        proc = start_scheduler(redis_server.url, prefix, port, log)
        await wait_serving(port, proc)

        async def all_done():
            return all(s == "COMPLETED" for s in await states())
        try:
            await wait_for(all_done, timeout_s=60)
        except AssertionError:
            log.flush()
            raise AssertionError(f"states {await states()}; scheduler log:\n"
                                 f"{(tmp_path / 'scheduler.log').read_text()[-4000:]}") from None
        for rid in rids:
            entries = await store.client.xrange(store.keys.output(rid))
            assert [int(f[b"i"]) for _, f in entries if b"i" in f] == list(range(20)), rid
        assert (await store.load()).get("n", 0) == 0
    finally:
        proc.kill()
        proc.wait()
        log.close()
        await workers.stop()


def test_a_durable_redis_killed_and_restarted_keeps_every_accepted_request(tmp_path, prefix):
    port = free_port()
    server = RedisServer(directory=str(tmp_path), port=port, durable=True).start()
    try:
        store = SyncStore(redis.Redis.from_url(server.url), prefix)
        for k in range(50):
            assert store.submit(spec(f"r{k}", tenant=f"t{k % 3}")).kind == "created"
        store.claim([("r0", "d1")], "p1")
        server.process.kill()  # no shutdown: only what reached the AOF survives
        server.process.wait()
        server = RedisServer(directory=str(tmp_path), port=port, durable=True).start()
        store = SyncStore(redis.Redis.from_url(server.url), prefix)
        assert store.load()["n"] == 49
        assert store.record("r0")["state"] == "PREFILLING"
        assert all(store.record(f"r{k}")["state"] == "QUEUED" for k in range(1, 50))
        assert store.claim([("r1", "d1")], "p1")[0].epoch == 1
    finally:
        server.stop()
