"""A worker takes work only while it can do it: before its model is loaded it answers
UNAVAILABLE and is not in the registry; once its model loop died it grants no reservation,
refuses hand-offs and prefill batches, and leaves the registry. Real workers in this process
(gRPC on loopback, the test Redis, the built-in model)."""

import asyncio
import time

import grpc
import pytest
import torch

from decode_worker.server import build_server as build_decode
from pdq.transport import kv_transfer
from pdq.observability import liveness
from pdq.config import DecodeConfig, PrefillConfig
from pdq.transport.serving import GRPC_OPTIONS
from pdq.transport.status import StatusError
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from prefill_worker.server import PUSH_KV, PrefillService


class LoopKilled(BaseException):
    """Not an Exception: nothing in the loop catches it, as with a bug that escapes it."""


class Poison:
    """An inbox item that kills the decode loop that takes it."""

    @property
    def header(self):
        raise LoopKilled("poisoned by the test")


def config(redis_url: str, prefix: str, worker_id: str) -> DecodeConfig:
    return DecodeConfig(redis_url=redis_url, key_prefix=prefix, port=0, model="builtin:tiny", threads=1,
                        max_seq_len=256, kv_budget_tokens=512, heartbeat_s=0.2, worker_id=worker_id,
                        dtype="float32")  # as the hand-offs the tests send (CPUs with AMX or AVX512_BF16 default to bfloat16)


def handoff(rid: str, runner) -> list[bytes]:
    shape = (runner.num_kv_heads, 4, runner.head_dim)
    layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(runner.num_layers)]
    header = pb.KVHeader(spec=pb.RequestSpec(request_id=rid, prompt_token_ids=[1] * 4,
                                             sampling=gen_pb.SamplingParams(max_tokens=2)),
                         epoch=1, generated_token_ids=[1])
    return list(kv_transfer.encode_frames(header, layers))


async def wait_for(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(0.02)
    return got


@pytest.fixture
def fatal():
    reasons: list[str] = []
    liveness.on_fatal(reasons.append)
    yield reasons
    liveness.on_fatal(lambda reason: None)


async def test_a_worker_whose_model_is_loading_answers_unavailable_and_is_not_in_the_registry(
        redis_server, redis_client, prefix):
    server = build_decode(config(redis_server.url, prefix, "d-loading"))
    loading = asyncio.Event()
    server.on_start.insert(0, loading.wait)  # its model loads once this returns
    starting = asyncio.create_task(server.start())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        await channel.channel_ready()  # the port is open, the model not loaded
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Reserve(pb.ReserveRequest(request_id="early", tokens=10), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving yet" in err.value.details()
        assert redis_client.zscore(f"{prefix}:workers:decode", "d-loading") is None
        loading.set()
        await asyncio.wait_for(starting, 120)
        try:
            # in the registry once started, and only then: its first heartbeat is in start()
            assert redis_client.zscore(f"{prefix}:workers:decode", "d-loading") is not None
            assert (await stub.Reserve(pb.ReserveRequest(request_id="now", tokens=10), timeout=5)).granted
        finally:
            await asyncio.wait_for(server.stop(0.5), 15)


async def test_a_decode_worker_whose_model_loop_died_takes_no_work_and_leaves_the_registry(
        redis_server, redis_client, prefix, fatal):
    server = build_decode(config(redis_server.url, prefix, "d-dying"))
    await server.start()
    service = server.service
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            push = channel.stream_unary(PUSH_KV, request_serializer=None,
                                        response_deserializer=pb.PushKVResponse.FromString)
            assert (await stub.Reserve(pb.ReserveRequest(request_id="before", tokens=10), timeout=5)).granted
            service.loop.add(Poison())
            await wait_for("the loop to die", lambda: not service.loop.alive)
            assert fatal and fatal[0].startswith("decode-loop: LoopKilled")  # the process would go down now
            got = await stub.Reserve(pb.ReserveRequest(request_id="after", tokens=10), timeout=5)
            assert not got.granted and got.free_slots == 0
            # a hold granted before is no longer honoured either
            assert not (await stub.Reserve(pb.ReserveRequest(request_id="before", tokens=10), timeout=5)).granted
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await push(iter(handoff("before", service.loop.runner)), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not serving" in err.value.details()
            await wait_for("the worker to leave the registry",
                           lambda: redis_client.hget(f"{prefix}:worker:d-dying", "draining") == b"1")
    finally:
        await asyncio.wait_for(server.stop(0.5), 15)


async def test_a_prefill_worker_without_a_running_model_loop_refuses_batches_with_unavailable():
    service = PrefillService(PrefillConfig())
    with pytest.raises(StatusError) as err:
        await service.Prefill(pb.PrefillBatch(items=[pb.PrefillItem(spec=pb.RequestSpec(request_id="r"))]), None)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.retry_ms > 0
