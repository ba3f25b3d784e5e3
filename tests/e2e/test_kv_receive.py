"""A decode worker receives hand-offs straight into its KV pool and gives the slot back on
every failure: a real worker in this process (gRPC on loopback, the test Redis, the built-in
model), so the test can look at its pool."""

import asyncio
import contextlib
import time

import grpc
import pytest
import torch

from decode_worker.server import build_server
from pdq.transport import kv_transfer
from pdq.config import DecodeConfig
from pdq.transport.serving import GRPC_OPTIONS
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from prefill_worker.server import PUSH_KV


@contextlib.asynccontextmanager
async def decode_worker(redis_url: str, prefix: str, **config_kw):
    # float32 on every machine (a CPU with AMX or AVX512_BF16 would default to bfloat16): the hand-offs here are float32's
    config = DecodeConfig(redis_url=redis_url, key_prefix=prefix, port=0, model="builtin", threads=1,
                          max_seq_len=256, kv_budget_tokens=512, heartbeat_s=0.5,
                          **{"max_batch_size": 2, "dtype": "float32", **config_kw})  # 2 seats, 32 KV blocks of 16
    server = build_server(config)
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=GRPC_OPTIONS)
    try:
        yield server, channel
    finally:
        await channel.close()
        await asyncio.wait_for(server.stop(0.5), 15)


def cache(runner, tokens: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (runner.num_kv_heads, tokens, runner.head_dim)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(runner.num_layers)]


def frames(rid: str, layers, corrupt: bool = False, prompt: list[int] | None = None, skip: int = 0) -> list[bytes]:
    """A hand-off of `layers` (all positions), leaving out the K/V of the first `skip`."""
    prompt = prompt if prompt is not None else [1] * layers[0][0].shape[1]
    header = pb.KVHeader(spec=pb.RequestSpec(request_id=rid, prompt_token_ids=prompt,
                                             sampling=gen_pb.SamplingParams(max_tokens=2)),
                         epoch=1, generated_token_ids=[1], skip_tokens=skip)
    out = list(kv_transfer.encode_frames(header, [(k[:, skip:], v[:, skip:]) for k, v in layers]))
    if corrupt:  # one byte of the first data message, which holds several layers
        data = bytearray(out[1])
        data[len(data) // 2] ^= 0x01
        out[1] = bytes(data)
    return out


async def wait_for(what: str, cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def worker(redis_server, prefix: str, **config_kw):
    """(service, runner, DecodeWorker stub, PushKV taking frames) of a worker in this process."""
    async with decode_worker(redis_server.url, prefix, **config_kw) as (server, channel):
        yield server.service, server.service.loop.runner, pb_grpc.DecodeWorkerStub(channel), channel.stream_unary(
            PUSH_KV, request_serializer=None, response_deserializer=pb.PushKVResponse.FromString)


async def test_corrupt_multi_layer_chunk_is_rejected_and_its_slot_freed_then_a_retry_lands(redis_server, prefix):
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        layers = cache(runner, 50)  # 50 tokens x 16 KiB (small model): every layer in one data message
        assert kv_transfer.num_messages(layers, 1 << 20) == 3
        assert (await stub.Reserve(pb.ReserveRequest(request_id="r1", tokens=51), timeout=5)).granted
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push(iter(frames("r1", layers, corrupt=True)), timeout=10)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details()
        assert runner.free_tokens == runner.capacity_tokens  # freed before the call failed: nothing to poll for
        assert service.holds["r1"] is not None  # still reserved: the retry may come
        assert (await push(iter(frames("r1", layers)), timeout=10)).accepted
        assert service.holds.get("r1") is None  # running here (None), or already done (gone); no longer reserved



async def test_a_hand_off_leaves_out_the_prefix_this_worker_holds_and_is_refused_when_it_does_not(
        redis_server, prefix):
    async with worker(redis_server, prefix, max_batch_size=4) as (service, runner, stub, push):
        system = list(range(3, 51))  # 48 tokens: three full blocks of 16
        first, second = cache(runner, 60, seed=1), cache(runner, 60, seed=2)
        for rid in ("first", "second", "stranger"):
            assert (await stub.Reserve(pb.ReserveRequest(request_id=rid, tokens=61), timeout=5)).granted
        assert (await push(iter(frames("first", first, prompt=system + [7] * 12)), timeout=10)).accepted
        whole = sum(len(f) for f in frames("second", second, prompt=system + [8] * 12))
        sent = frames("second", second, prompt=system + [8] * 12, skip=48)  # its K/V of 12 positions of 60
        assert sum(len(f) for f in sent) < whole * 12 / 60 + 4096
        assert (await push(iter(sent), timeout=10)).accepted  # the three blocks "first" brought are shared

        other = [90 + i for i in range(48)] + [7] * 12  # no block of it is held here
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push(iter(frames("stranger", cache(runner, 60), prompt=other, skip=48)), timeout=10)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "PREFIX_MISSING" in err.value.details()
        assert service.holds["stranger"] is not None  # still reserved, nothing of it held: the whole K/V may come
        assert (await push(iter(frames("stranger", cache(runner, 60), prompt=other)), timeout=10)).accepted


async def test_hand_off_without_reservation_takes_no_slot(redis_server, prefix):
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await push(iter(frames("nobody", cache(runner, 10))), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert runner.free_tokens == runner.capacity_tokens



async def test_a_stream_that_breaks_mid_transfer_gives_its_slot_back(redis_server, prefix):
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        assert (await stub.Reserve(pb.ReserveRequest(request_id="r2", tokens=201), timeout=5)).granted
        sent = frames("r2", cache(runner, 200))  # 3.2 MB: 4 data messages
        header_and_some = sent[:3]  # the header and 2 data messages, then the sender goes away
        gate = asyncio.Event()

        async def requests():
            for f in header_and_some:
                yield f
            await gate.wait()  # never set: the call is cancelled while the slot is held

        call = push(requests(), timeout=10)
        await wait_for("the slot to be taken", lambda: runner.free_tokens < runner.capacity_tokens)
        call.cancel()
        await wait_for("the slot to be given back", lambda: runner.free_tokens == runner.capacity_tokens)
        assert service.holds["r2"] is not None  # the reservation stays until released or expired


async def test_a_reservation_does_not_expire_while_its_hand_off_arrives(redis_server, prefix):
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        assert (await stub.Reserve(pb.ReserveRequest(request_id="r3", tokens=201), timeout=5)).granted
        sent = frames("r3", cache(runner, 200))  # 4 data messages
        gate = asyncio.Event()

        async def requests():
            for f in sent[:2]:
                yield f
            await gate.wait()  # the transfer stalls here, slot taken
            for f in sent[2:]:
                yield f

        call = push(requests(), timeout=10)
        await wait_for("the slot to be taken", lambda: runner.free_tokens < runner.capacity_tokens)
        service.holds["r3"] = time.monotonic() - 1.0  # its reservation is past due mid-transfer
        service.expire()
        assert "r3" in service.holds  # kept: the room is in use by the arriving cache
        gate.set()
        assert (await call).accepted
        assert service.holds.get("r3") is None and not service.receiving  # running, or already done


async def test_a_worker_restarted_under_its_old_id_gives_back_what_that_id_held(redis_server, prefix):
    """A fixed worker id (or a container restarted with the same hostname and pid 1) heartbeats
    again before anyone noticed the old process died; its new life requeues the old one's work."""
    import redis

    from pdq.state.store import SyncStore

    store = SyncStore(redis.Redis.from_url(redis_server.url), prefix)
    try:
        spec = pb.RequestSpec(request_id="orphan", tenant="t", prompt_token_ids=[5] * 4, arrival_ms=1,
                              sampling=gen_pb.SamplingParams(max_tokens=4))
        store.submit(spec)
        assert store.claim([("orphan", "decode-fixed")], "prefill-x")[0].epoch == 1  # the previous life's attempt
        async with decode_worker(redis_server.url, prefix, worker_id="decode-fixed"):
            rec = store.record("orphan")
            assert rec["state"] == "QUEUED" and rec["epoch"] == "2"  # requeued, the old attempt fenced off
            assert not store.client.exists(store.keys.held("decode-fixed"))
    finally:
        store.client.close()


async def test_a_reservation_that_must_keep_slots_free_is_refused_once_they_are_the_last(redis_server, prefix):
    """ReserveRequest.keep_free: the scheduler's reserve for tenants below their share, checked
    against the worker's own count (2 slots here)."""
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        async def reserve(rid: str, keep_free: int) -> pb.ReserveResponse:
            return await stub.Reserve(pb.ReserveRequest(request_id=rid, tokens=10, keep_free=keep_free), timeout=5)

        assert (await reserve("over-share-1", 1)).granted  # 2 free > 1
        refused = await reserve("over-share-2", 1)  # 1 free: the last one stays for a tenant below its share
        assert not refused.granted and refused.free_slots == 1
        assert (await reserve("over-share-1", 1)).granted  # a request holding a slot keeps it
        last = await reserve("below-share", 0)
        assert last.granted and last.free_slots == 0 and service.free_slots == 0


async def test_a_reservation_is_granted_by_the_kv_blocks_its_prompt_and_max_tokens_need(redis_server, prefix):
    """Seats free, blocks not: the worker grants what fits its free KV blocks (32 of 16 here),
    counting the blocks of grants whose KV has not arrived yet."""
    async with worker(redis_server, prefix, max_batch_size=8) as (service, runner, stub, push):
        async def reserve(rid: str, tokens: int) -> pb.ReserveResponse:
            return await stub.Reserve(pb.ReserveRequest(request_id=rid, tokens=tokens), timeout=5)

        assert (await reserve("big", 256)).granted  # 16 blocks, pending until its KV arrives
        assert service.free_blocks == 16
        assert (await reserve("b", 200)).granted  # 13 blocks
        assert not (await reserve("too-big", 100)).granted  # 7 blocks: a seat is free, the blocks are not
        assert (await reserve("fits", 48)).granted  # 3 blocks
        assert service.free_blocks == 0 and runner.free_blocks == 32  # granted, not yet taken from the pool


async def test_reserve_many_answers_in_order_as_one_reserve_per_item_would(redis_server, prefix):
    """ReserveMany (a dispatch round's reservations in one call): each item sees the slots the
    items before it took (2 slots here)."""
    async with worker(redis_server, prefix) as (service, runner, stub, push):
        items = [pb.ReserveRequest(request_id="a", tokens=10, keep_free=0),
                 pb.ReserveRequest(request_id="b", tokens=10, keep_free=1),  # 1 free left: refused
                 pb.ReserveRequest(request_id="a", tokens=10, keep_free=1),  # a holds one: kept
                 pb.ReserveRequest(request_id="c", tokens=10, keep_free=0)]
        got = (await stub.ReserveMany(pb.ReserveManyRequest(items=items), timeout=5)).items
        assert [(r.granted, r.free_slots) for r in got] == [(True, 1), (False, 1), (True, 1), (True, 0)]
        assert set(service.holds) == {"a", "c"} and service.free_slots == 0
        assert not (await stub.ReserveMany(pb.ReserveManyRequest(items=items[1:2]), timeout=5)).items[0].granted


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
async def test_a_prefill_worker_sends_the_whole_cache_again_when_the_prefix_it_left_out_is_gone(
        redis_server, prefix, transport):
    """The scheduler saw the decode worker's heartbeat name a prefix, but the blocks were evicted
    before the hand-off came: PREFIX_MISSING, and the prefill worker sends all of the K/V."""
    from pdq.config import PrefillConfig
    from pdq.observability import metrics
    from prefill_worker.loop import Outcome
    from prefill_worker.server import PrefillService

    async with decode_worker(redis_server.url, prefix) as (server, channel):
        service, runner, stub = server.service, server.service.loop.runner, pb_grpc.DecodeWorkerStub(channel)
        reserved = await stub.Reserve(pb.ReserveRequest(request_id="gone", tokens=61), timeout=5)
        assert reserved.granted
        prompt = [60 + i for i in range(59)]
        spec = pb.RequestSpec(request_id="gone", prompt_token_ids=prompt, sampling=gen_pb.SamplingParams(max_tokens=2))
        item = pb.PrefillItem(spec=spec, epoch=1, decode_address=f"127.0.0.1:{server.port}",
                              decode_kv_address=reserved.kv_address if transport == "tcp" else "",
                              decode_cached_tokens=48)
        sender = PrefillService(PrefillConfig(redis_url=redis_server.url, key_prefix=prefix))
        misses = metrics.KV_PREFIX_MISSES._value.get()
        done = asyncio.get_running_loop().create_future()
        done.set_result(Outcome("handoff", generated=[5, 9], layers=cache(runner, 60)))
        result = await sender._finish(item, done)
        assert result.ok, result.error
        assert metrics.KV_PREFIX_MISSES._value.get() == misses + 1
        assert service.holds.get("gone") is None  # it arrived: running here, or already done
