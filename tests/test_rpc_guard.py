"""The guard of every pdq server (pdq.transport.rpc_guard): requests that do not parse get INVALID_ARGUMENT
naming the field, calls before the server is ready get UNAVAILABLE with a retry hint, and an
unexpected error in a handler is answered UNAVAILABLE, never UNKNOWN."""

import asyncio

import grpc
import pytest
from grpc_status import rpc_status

from pdq.config import SchedulerConfig
from pdq.transport.rpc_guard import describe_bad_message
from pdq.transport.serving import Server
from pdq.transport.status import StatusError
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from pdq.v1 import operator_pb2 as op_pb


def _corrupt(message, good: bytes, bad: bytes) -> bytes:
    raw = message.SerializeToString()
    assert raw.count(good) == 1
    return raw.replace(good, bad)


def test_invalid_utf8_names_the_string_field_that_holds_it():
    req = gen_pb.GenerateRequest(prompt="hello", tier="batch", sampling=gen_pb.SamplingParams(stop=["ab", "cd"]))
    assert describe_bad_message(_corrupt(req, b"hello", b"he\xfflo"), gen_pb.GenerateRequest).field == "prompt"
    assert describe_bad_message(_corrupt(req, b"cd", b"c\xc3"), gen_pb.GenerateRequest).field == "sampling.stop[1]"
    assert describe_bad_message(_corrupt(req, b"batch", b"bat\x80h"), gen_pb.GenerateRequest).field == "tier"
    policy = op_pb.TenantPolicy(tenant="acme", tier="batch")
    err = describe_bad_message(_corrupt(policy, b"acme", b"ac\xffe"), op_pb.TenantPolicy)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.field == "tenant"
    assert "tenant: is not valid UTF-8" in err.message


def test_bytes_that_are_no_message_at_all_are_refused_as_malformed():
    err = describe_bad_message(b"\xff\xff\xff", gen_pb.GenerateRequest)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == "MALFORMED_REQUEST"
    assert "not a valid GenerateRequest" in err.message


class _Scheduler(pb_grpc.SchedulerServicer):
    """A scheduler servicer whose Submit raises what the test says."""

    raise_next: BaseException | None = None

    async def Submit(self, request, context):
        if self.raise_next is not None:
            raise self.raise_next
        return pb.SubmitResponse(request_id=request.spec.request_id, created=True)


async def _serve(servicer, started: asyncio.Event):
    server = Server("127.0.0.1", 0, [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name])
    pb_grpc.add_SchedulerServicer_to_server(servicer, server.grpc)
    server.on_start.append(started.wait)  # not ready until the test says so
    return server


async def test_calls_before_the_server_is_ready_get_unavailable_with_a_retry_hint_then_succeed():
    go = asyncio.Event()
    server = await _serve(_Scheduler(), go)
    starting = asyncio.create_task(server.start())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            spec = pb.RequestSpec(request_id="r1", tenant="t", prompt_token_ids=[1])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Submit(pb.SubmitRequest(spec=spec), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not serving yet" in err.value.details()
            assert dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"] == "1000"
            go.set()
            await starting
            assert (await stub.Submit(pb.SubmitRequest(spec=spec), timeout=5)).created
    finally:
        go.set()
        await starting
        await server.stop(0)


@pytest.mark.parametrize("raised, code, words", [
    (ValueError("boom"), grpc.StatusCode.UNAVAILABLE, "unexpected server error (ValueError: boom)"),
    (ConnectionError("refused"), grpc.StatusCode.UNAVAILABLE, "Redis unreachable"),
    (StatusError(grpc.StatusCode.NOT_FOUND, "no such thing"), grpc.StatusCode.NOT_FOUND, "no such thing"),
])
async def test_what_a_handler_raises_becomes_a_deliberate_status(raised, code, words):
    import redis

    if isinstance(raised, ConnectionError):
        raised = redis.ConnectionError("refused")
    go = asyncio.Event()
    go.set()
    servicer = _Scheduler()
    servicer.raise_next = raised
    server = await _serve(servicer, go)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.SchedulerStub(channel).Submit(pb.SubmitRequest(), timeout=5)
            assert err.value.code() == code
            assert words in err.value.details()
            if code == grpc.StatusCode.UNAVAILABLE:  # a retry hint programs can read
                status = rpc_status.from_call(err.value)
                assert status is not None and any(d.type_url.endswith("RetryInfo") for d in status.details)
    finally:
        await server.stop(0)


async def test_invalid_utf8_on_the_wire_is_invalid_argument_naming_the_field():
    go = asyncio.Event()
    go.set()
    server = await _serve(_Scheduler(), go)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            raw = _corrupt(pb.SubmitRequest(spec=pb.RequestSpec(request_id="r1", tenant="acme")), b"acme", b"a\xffme")
            call = channel.unary_unary("/pdq.v1.Scheduler/Submit", request_serializer=None,
                                       response_deserializer=pb.SubmitResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(raw, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("spec.tenant: is not valid UTF-8")
    finally:
        await server.stop(0)


def test_config_rejects_a_nonpositive_pool_or_outage_window():
    with pytest.raises(ValueError, match="redis_max_connections"):
        SchedulerConfig(redis_max_connections=0)
    with pytest.raises(ValueError, match="redis_outage_s"):
        SchedulerConfig(redis_outage_s=0)
