"""The decode worker's TCP data plane (`--kv-transport tcp`): the same frames and checks as
PushKV, on kept-alive connections. A real worker in this process (loopback, the test Redis, the
built-in model), sent to with the prefill worker's own `kv_tcp.Pusher`."""

import asyncio
import struct

import grpc
import pytest

from pdq.transport import kv_tcp
from pdq.ops.redis_server import free_port
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from tests.e2e.test_kv_receive import cache, decode_worker, frames, wait_for


async def reserve(stub, rid: str, tokens: int) -> str:
    resp = await stub.Reserve(pb.ReserveRequest(request_id=rid, tokens=tokens), timeout=5)
    assert resp.granted
    return resp.kv_address


async def test_hand_offs_over_tcp_land_and_a_corrupt_one_is_refused_on_the_same_connection(redis_server, prefix):
    async with decode_worker(redis_server.url, prefix, kv_transport="tcp") as (server, channel):
        service, runner, stub = server.service, server.service.loop.runner, pb_grpc.DecodeWorkerStub(channel)
        pusher = kv_tcp.Pusher(None)
        try:
            address = await reserve(stub, "r1", 51)
            assert address.endswith(f":{service.kv_address.rsplit(':', 1)[1]}") and address != f"127.0.0.1:{server.port}"
            with pytest.raises(kv_tcp.Refused) as err:
                await pusher.push(address, frames("r1", cache(runner, 50), corrupt=True))
            assert err.value.code == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details
            assert runner.free_tokens == runner.capacity_tokens  # freed before the answer
            assert service.holds["r1"] is not None  # still reserved: the retry may come

            with pytest.raises(kv_tcp.Refused) as err:  # no reservation: refused, nothing taken
                await pusher.push(address, frames("nobody", cache(runner, 10)))
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no KV reservation" in err.value.details
            assert runner.free_tokens == runner.capacity_tokens

            await pusher.push(address, frames("r1", cache(runner, 50)))  # the retry lands
            assert service.holds.get("r1") is None  # running here (None), or already done (gone); no longer reserved
            assert len(pusher._idle[address]) == 1  # every hand-off went over one kept-alive connection
            # PushKV still works on a worker with a data plane
            await reserve(stub, "r2", 11)
            push = channel.stream_unary("/pdq.v1.DecodeWorker/PushKV", request_serializer=None,
                                        response_deserializer=pb.PushKVResponse.FromString)
            assert (await push(iter(frames("r2", cache(runner, 10))), timeout=10)).accepted
        finally:
            await pusher.close()


async def test_a_connection_that_breaks_mid_transfer_gives_its_slot_back(redis_server, prefix):
    async with decode_worker(redis_server.url, prefix, kv_transport="tcp") as (server, channel):
        service, runner, stub = server.service, server.service.loop.runner, pb_grpc.DecodeWorkerStub(channel)
        address = await reserve(stub, "r2", 201)
        sent = frames("r2", cache(runner, 200))  # 3.2 MB: header, 4 data messages, trailer
        host, port = kv_tcp.split_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(struct.pack("<I", 0))  # no traceparent
        for frame in sent[:3]:
            writer.write(struct.pack("<I", len(frame)) + frame)
        await writer.drain()
        await wait_for("the slot to be taken", lambda: runner.free_tokens < runner.capacity_tokens)
        writer.close()  # the sender goes away midway
        await wait_for("the slot to be given back", lambda: runner.free_tokens == runner.capacity_tokens)
        assert service.holds["r2"] is not None and not service.receiving


async def test_an_oversized_frame_is_refused_and_the_connection_closed(redis_server, prefix):
    async with decode_worker(redis_server.url, prefix, kv_transport="tcp") as (server, channel):
        address = await reserve(pb_grpc.DecodeWorkerStub(channel), "r3", 11)
        reader, writer = await asyncio.open_connection(*kv_tcp.split_address(address))
        writer.write(struct.pack("<II", 0, kv_tcp.MAX_FRAME + 1))
        code, n = struct.unpack("<BI", await asyncio.wait_for(reader.readexactly(5), 10))
        assert grpc.StatusCode.INVALID_ARGUMENT.value[0] == code
        assert b"at most" in await reader.readexactly(n)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the worker
        writer.close()
        assert server.service.loop.runner.free_tokens == server.service.loop.runner.capacity_tokens


async def test_an_unreachable_data_plane_is_unavailable():
    pusher = kv_tcp.Pusher(None)
    with pytest.raises(kv_tcp.Refused) as err:
        await pusher.push(f"127.0.0.1:{free_port()}", [b"x"], timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "connection failed" in err.value.details


async def test_idle_connections_to_a_worker_that_left_are_closed():
    """A decode worker that leaves closes its end; the pusher drops such idle connections the
    next time it opens one (it does not keep sockets to workers that are gone)."""
    closed = asyncio.Event()

    async def one_hand_off_then_leave(conn: kv_tcp.Receiver) -> None:
        await conn.blob()  # traceparent
        while await conn.blob():  # frames, up to the end marker
            pass
        conn.transport.write(struct.pack("<BI", 0, 0))  # accepted
        conn.transport.close()
        closed.set()

    leaving = await asyncio.get_running_loop().create_server(
        lambda: kv_tcp.Receiver(one_hand_off_then_leave), "127.0.0.1", 0)
    staying = await kv_tcp.serve("127.0.0.1", 0, lambda frames, tp: _consume(frames), None)
    a, b = (f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in (leaving, staying))
    pusher = kv_tcp.Pusher(None)
    try:
        await pusher.push(a, [b"frame"])
        await closed.wait()
        reader, _ = pusher._idle[a][0]
        await wait_for("the pusher to see the close", reader.at_eof)
        await pusher.push(b, [b"frame"])  # opens a connection: sweeps the dead one
        assert a not in pusher._idle and len(pusher._idle[b]) == 1
    finally:
        await pusher.close()
        leaving.close()
        staying.close()


async def _consume(frames) -> None:
    async for _ in frames:
        pass
