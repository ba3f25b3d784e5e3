"""The Python clients against a real cluster: the asyncio client has every call of the sync one
and gets the same answers, and closing either one with calls in flight returns at once, ends
those calls with CANCELLED and cancels their requests."""

import asyncio
import inspect
import threading
import time

import grpc
import pytest

from pdq.client import AsyncClient, Client
from pdq.v1 import generation_pb2 as gen_pb
from tests.e2e.conftest import KEYS
from tests.streams import streamed

CLOSE_S = 10.0  # far more than closing takes; past it, closing hung


def public_calls(cls: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(cls, callable) if not name.startswith("_")}


def wait_state(store_client, rid: str, state: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := store_client.hget(f"pdq:req:{rid}", "state")) != state.encode():
        assert time.monotonic() < deadline, f"{rid} is {got}, not {state}, after {timeout_s}s"
        time.sleep(0.02)


def test_the_asyncio_client_has_every_call_of_the_sync_one():
    assert public_calls(Client) <= public_calls(AsyncClient)
    for name in public_calls(Client) - {"request", "close"}:  # same arguments, same defaults
        sync, aio = inspect.signature(getattr(Client, name)), inspect.signature(getattr(AsyncClient, name))
        assert sync.parameters == aio.parameters, name


def test_the_asyncio_client_submits_fetches_resumes_and_cancels_as_the_sync_one(cluster, client):
    rid = client.submit("twins", max_tokens=10, ignore_eos=True)
    want = client.get_result(rid, wait_ms=60_000)
    assert want.state == "COMPLETED"

    async def main():
        async with AsyncClient(cluster.target, api_key=KEYS["acme"]) as c:
            arid = await c.submit("twins", max_tokens=10, ignore_eos=True)
            first = await c.get_result(arid)  # answers at once, whatever the state
            done = await c.get_result(arid, wait_ms=60_000)
            resumed = [m async for m in c.stream_result(arid, offset=6)]
            queued = await c.submit("cancel me", max_tokens=1500, ignore_eos=True)
            cancelled = await c.cancel(queued)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await c.get_result("no-such-request")
            return arid, first, done, resumed, cancelled, missing.value.code()

    arid, first, done, resumed, cancelled, missing = asyncio.run(main())
    assert first.request_id == arid and first.state
    assert done.done and done.state == "COMPLETED" and list(done.result.token_ids) == list(want.result.token_ids)
    assert streamed(resumed) == ([6, 7, 8, 9], list(want.result.token_ids[6:]))
    assert resumed[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert cancelled == "CANCELLED" and missing == grpc.StatusCode.NOT_FOUND


async def drain(stream) -> list:
    return [m async for m in stream]


def test_closing_the_asyncio_client_mid_calls_returns_at_once_and_cancels_them(cluster, store_client):
    async def main():
        c = AsyncClient(cluster.target, api_key=KEYS["acme"])
        stream = c.generate_stream("close me", max_tokens=1500, ignore_eos=True)
        streamed = (await anext(stream)).request_id
        await anext(stream)  # a token: it is decoding
        polled = await c.submit("long-polled", max_tokens=1500, ignore_eos=True)
        poll = asyncio.create_task(c.get_result(polled, wait_ms=60_000))
        follow = asyncio.create_task(drain(c.stream_result(streamed, offset=10_000)))  # waits for far tokens
        await asyncio.sleep(0.1)  # (started or not, a call that the closing cuts ends CANCELLED)
        await asyncio.wait_for(c.close(), CLOSE_S)
        await asyncio.wait_for(c.close(), CLOSE_S)  # twice is fine
        outcomes = await asyncio.wait_for(asyncio.gather(poll, follow, return_exceptions=True), CLOSE_S)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await anext(stream)
        return streamed, polled, outcomes, err.value.code()

    streamed, polled, outcomes, after = asyncio.run(main())
    assert [o.code() for o in outcomes] == [grpc.StatusCode.CANCELLED] * 2, outcomes
    assert after == grpc.StatusCode.CANCELLED
    wait_state(store_client, streamed, "CANCELLED")  # the closed stream's request, as on a disconnect
    with Client(cluster.target, api_key=KEYS["acme"]) as c:  # a submitted one lives on: the client only left
        assert c.cancel(polled) == "CANCELLED"


def test_closing_the_sync_client_mid_calls_returns_at_once_and_cancels_them(cluster, store_client):
    c = Client(cluster.target, api_key=KEYS["acme"])
    stream = c.generate_stream("close me too", max_tokens=1500, ignore_eos=True)
    streamed = next(stream).request_id
    next(stream)  # a token: it is decoding
    polled = c.submit("long-polled", max_tokens=1500, ignore_eos=True)
    # calls in flight when the client closes (a sync call starts when it is made):
    poll = c.stub.GetResult.future(gen_pb.GetResultRequest(request_id=polled, wait_ms=60_000), metadata=c.metadata)
    follow = c.stub.StreamResult(gen_pb.StreamResultRequest(request_id=streamed, offset=10_000), metadata=c.metadata)
    outcome: list = []

    def blocked_reader() -> None:  # as a thread blocked on a stream (waiting for a far token)
        try:
            outcome.append(list(follow))  # its first message (the request id), then nothing
        except grpc.RpcError as exc:
            outcome.append(exc.code())

    reader = threading.Thread(target=blocked_reader, daemon=True)
    reader.start()
    closer = threading.Thread(target=lambda: (c.close(), c.close()), daemon=True)  # twice is fine
    closer.start()
    closer.join(CLOSE_S)
    assert not closer.is_alive(), "Client.close() hung"
    reader.join(CLOSE_S)
    assert outcome == [grpc.StatusCode.CANCELLED]
    assert poll.exception(timeout=CLOSE_S).code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_state(store_client, streamed, "CANCELLED")  # the closed stream's request, as on a disconnect
    with Client(cluster.target, api_key=KEYS["acme"]) as other:  # a submitted one lives on: the client only left
        assert other.cancel(polled) == "CANCELLED"


@pytest.mark.parametrize("aio", [False, True])
def test_closing_a_client_of_an_unreachable_gateway_returns_at_once(aio):
    from pdq.ops.redis_server import free_port

    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    if aio:
        async def main():
            c = AsyncClient(target, api_key="k")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.get_result("x", timeout=CLOSE_S)
            await asyncio.wait_for(c.close(), CLOSE_S)
            return err.value.code()

        assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE  # fails fast, and closing does not hang
    else:
        c = Client(target, api_key="k")
        closer = threading.Thread(target=c.close, daemon=True)
        with pytest.raises(grpc.RpcError) as err:
            c.get_result("x", timeout=CLOSE_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # fails fast, no hang
        closer.start()
        closer.join(CLOSE_S)
        assert not closer.is_alive(), "Client.close() hung"
