"""The gateway never answers UNKNOWN or INTERNAL, and never mistakes its own failure for the
client's: every RPC of both services with broken input and with Redis down, over the wire.

A gateway and a scheduler (no workers: requests stay queued, and the test writes a request's
output stream itself where a decode worker would) on a durable Redis that the tests stop and
start again under them, with a 2 s outage window (PDQ_REDIS_OUTAGE_S).
"""

import asyncio
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import redis
from google.protobuf.descriptor import FieldDescriptor
from grpc_status import rpc_status

from pdq.ops.redis_server import RedisServer, free_port
from pdq.ops.up import Cluster
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from pdq.v1 import operator_pb2 as op_pb
from pdq.v1 import operator_pb2_grpc as op_grpc
from tests.e2e.conftest import KEYS
from tests.streams import streamed, until_tokens

OUTAGE_S = 2.0
CALL_TIMEOUT_S = 60.0
BUG = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
CLIENT = (("authorization", f"Bearer {KEYS['acme']}"),)
ADMIN = (("authorization", f"Bearer {KEYS['ops']}"),)
GENERATION = gen_pb.DESCRIPTOR.services_by_name["Generation"]
OPERATOR = op_pb.DESCRIPTOR.services_by_name["Operator"]
MARK = "PDQMARK"


@pytest.fixture(scope="module")
def redis_server_of_the_module():
    server = RedisServer(directory=tempfile.mkdtemp(prefix="pdq-gw-faults-"), durable=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bare(redis_server_of_the_module, auth_file):
    env = {"PDQ_AUTH_FILE": str(auth_file), "PDQ_REDIS_OUTAGE_S": str(OUTAGE_S)}
    with Cluster(model="builtin", port=0, auth=False, prefill=0, decode=0, http_port=free_port(),
                 redis_url=redis_server_of_the_module.url, extra_env=env) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def channel(bare):
    with grpc.insecure_channel(bare.target) as ch:
        yield ch


@pytest.fixture
def gen(channel):
    return gen_grpc.GenerationStub(channel)


@pytest.fixture
def op(channel):
    return op_grpc.OperatorStub(channel)


@pytest.fixture
def store(redis_server_of_the_module):
    client = redis.Redis.from_url(redis_server_of_the_module.url)
    yield client
    client.close()


def has_retry_info(err: grpc.RpcError) -> bool:
    status = rpc_status.from_call(err)
    return status is not None and any(d.type_url.endswith("google.rpc.RetryInfo") for d in status.details)


def outcome(call) -> tuple[grpc.StatusCode, grpc.RpcError | None]:
    """Runs `call` (a unary call, or a streaming one read to its end) -> (code, error)."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            for _ in result:
                pass
        return grpc.StatusCode.OK, None
    except grpc.RpcError as err:
        return err.code(), err


def play_worker(store, rid: str, start: int, n: int, end: bool = False) -> None:
    """Writes what a decode worker writes to the request's output stream: tokens start..start+n-1
    (token id 5 + index, text 't{index}'), then the end if asked."""
    for i in range(start, start + n):
        store.xadd(f"pdq:req:{rid}:out", {"i": i, "t": 5 + i, "x": f"t{i}"})
    if end:
        store.xadd(f"pdq:req:{rid}:out", {"done": "COMPLETED", "r": "length"})


def state(store, rid: str) -> str:
    return (store.hget(f"pdq:req:{rid}", "state") or b"").decode()


class RedisDown:
    """Stops the module's Redis; `back()` (or leaving the block) starts it again on its AOF."""

    def __init__(self, server: RedisServer):
        self.server = server
        self.up = True

    def __enter__(self) -> "RedisDown":
        self.server.stop()
        self.up = False
        return self

    def back(self) -> None:
        if not self.up:
            self.server.start()
            self.up = True

    def __exit__(self, *exc: object) -> None:
        self.back()


def valid_calls(gen, op, rid: str) -> dict[str, object]:
    """A valid call of every RPC of both services, by name."""
    prompt = gen_pb.GenerateRequest(prompt="ride it out", sampling=gen_pb.SamplingParams(max_tokens=2))
    t = dict(timeout=CALL_TIMEOUT_S)
    calls = {
        "Generate": lambda: gen.Generate(prompt, metadata=CLIENT, **t),
        "GenerateStream": lambda: gen.GenerateStream(prompt, metadata=CLIENT, **t),
        "Submit": lambda: gen.Submit(prompt, metadata=CLIENT, **t),
        "GetResult": lambda: gen.GetResult(gen_pb.GetResultRequest(request_id=rid), metadata=CLIENT, **t),
        "StreamResult": lambda: gen.StreamResult(gen_pb.StreamResultRequest(request_id=rid), metadata=CLIENT, **t),
        "Cancel": lambda: gen.Cancel(gen_pb.CancelRequest(request_id=rid), metadata=CLIENT, **t),
        "CancelRequest": lambda: op.CancelRequest(op_pb.OperatorCancelRequest(request_id=rid), metadata=ADMIN, **t),
        "CancelTenant": lambda: op.CancelTenant(op_pb.CancelTenantRequest(tenant="nobody"), metadata=ADMIN, **t),
        "SetDeadline": lambda: op.SetDeadline(op_pb.SetDeadlineRequest(request_id=rid, timeout_ms=600_000),
                                              metadata=ADMIN, **t),
        "GetRequest": lambda: op.GetRequest(op_pb.GetRequestRequest(request_id=rid), metadata=ADMIN, **t),
        "ListRequests": lambda: op.ListRequests(op_pb.ListRequestsRequest(), metadata=ADMIN, **t),
        "ListWorkers": lambda: op.ListWorkers(op_pb.ListWorkersRequest(), metadata=ADMIN, **t),
        "DrainWorker": lambda: op.DrainWorker(op_pb.DrainWorkerRequest(worker_id="w-none"), metadata=ADMIN, **t),
        "UndrainWorker": lambda: op.UndrainWorker(op_pb.DrainWorkerRequest(worker_id="w-none"), metadata=ADMIN, **t),
        "PauseQueue": lambda: op.PauseQueue(op_pb.PauseQueueRequest(tenant="nobody"), metadata=ADMIN, **t),
        "ResumeQueue": lambda: op.ResumeQueue(op_pb.PauseQueueRequest(tenant="nobody"), metadata=ADMIN, **t),
        "SetTenantPolicy": lambda: op.SetTenantPolicy(op_pb.TenantPolicy(tenant="nobody", weight=1.0),
                                                      metadata=ADMIN, **t),
        "ListTenants": lambda: op.ListTenants(op_pb.ListTenantsRequest(), metadata=ADMIN, **t),
        "GetStats": lambda: op.GetStats(op_pb.GetStatsRequest(), metadata=ADMIN, **t),
    }
    assert set(calls) == {m.name for m in GENERATION.methods} | {m.name for m in OPERATOR.methods}
    return calls


def test_every_rpc_answers_unavailable_with_a_retry_hint_while_redis_is_down_then_works_again(
        bare, gen, op, redis_server_of_the_module):
    rid = gen.Submit(gen_pb.GenerateRequest(prompt="queued", request_id="sweep-1"), metadata=CLIENT).request_id
    calls = valid_calls(gen, op, rid)
    with RedisDown(redis_server_of_the_module), ThreadPoolExecutor(len(calls)) as pool:
        during = dict(zip(calls, pool.map(outcome, calls.values())))
    for name, (code, err) in during.items():
        assert code == grpc.StatusCode.UNAVAILABLE, (name, code, err and err.details())
        assert has_retry_info(err), (name, err.details())
    # the same processes, nothing restarted: every call is answered again
    calls = valid_calls(gen, op, rid)
    calls["Generate"] = lambda: gen.Generate(gen_pb.GenerateRequest(prompt="after", timeout_ms=300), metadata=CLIENT)
    streams = {name: calls.pop(name)() for name in ("GenerateStream", "StreamResult")}
    for name, stream in streams.items():  # nothing generates here: the first message (the id) is the answer
        assert next(stream).request_id, name
        stream.cancel()
    cancels = {name: calls.pop(name) for name in ("Cancel", "CancelRequest", "CancelTenant")}  # last
    after = {name: outcome(call) for name, call in [*calls.items(), *cancels.items()]}
    expected = {"Generate": grpc.StatusCode.DEADLINE_EXCEEDED, "DrainWorker": grpc.StatusCode.NOT_FOUND,
                "UndrainWorker": grpc.StatusCode.NOT_FOUND}
    for name, (code, err) in after.items():
        assert code == expected.get(name, grpc.StatusCode.OK), (name, code, err and err.details())
    assert bare.dead_child() is None


def test_a_stream_pauses_through_a_short_outage_and_loses_nothing(bare, gen, store, redis_server_of_the_module):
    stream = gen.GenerateStream(gen_pb.GenerateRequest(prompt="pause me", request_id="pause-1"), metadata=CLIENT,
                                timeout=CALL_TIMEOUT_S)
    rid = next(stream).request_id
    play_worker(store, rid, 0, 3)
    got = until_tokens(stream, 3)
    with RedisDown(redis_server_of_the_module) as down:
        time.sleep(OUTAGE_S / 2)  # an outage shorter than the window (the point of the test, not a wait)
        down.back()
        play_worker(store, rid, 3, 3, end=True)
    got += list(stream)
    assert streamed(got) == (list(range(6)), [5 + i for i in range(6)])  # nothing lost, nothing twice
    assert got[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    gen.Cancel(gen_pb.CancelRequest(request_id=rid), metadata=CLIENT)


def test_the_http_door_answers_503_with_retry_after_while_redis_is_down(bare, redis_server_of_the_module):
    with openai.OpenAI(base_url=bare.base_url, api_key=KEYS["acme"], max_retries=0, timeout=CALL_TIMEOUT_S) as oa:
        with RedisDown(redis_server_of_the_module):
            with pytest.raises(openai.APIStatusError) as err:
                oa.completions.create(model="builtin", prompt="ride it out", max_tokens=2)
        assert err.value.status_code == 503 and int(err.value.response.headers["Retry-After"]) >= 1
        assert err.value.body["type"] == "server_error" and "Redis" in err.value.body["message"]


def test_past_the_window_calls_end_unavailable_with_where_to_resume_and_the_request_goes_on(
        bare, gen, store, redis_server_of_the_module):
    stream = gen.GenerateStream(gen_pb.GenerateRequest(prompt="resume me", request_id="resume-1"), metadata=CLIENT,
                                timeout=CALL_TIMEOUT_S)
    rid = next(stream).request_id
    unary = gen.Generate.future(gen_pb.GenerateRequest(prompt="fetch me later", request_id="resume-2"),
                                metadata=CLIENT, timeout=CALL_TIMEOUT_S)
    while not store.exists("pdq:idem:acme:resume-2"):  # the unary call's request is in
        time.sleep(0.01)
    unary_rid = store.get("pdq:idem:acme:resume-2").decode()
    play_worker(store, rid, 0, 2)
    assert streamed(until_tokens(stream, 2))[0] == [0, 1]
    with RedisDown(redis_server_of_the_module) as down:
        with pytest.raises(grpc.RpcError) as err:
            next(stream)
        with pytest.raises(grpc.RpcError) as unary_err:
            unary.result()
        down.back()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and has_retry_info(err.value)
    assert f"resume with StreamResult(request_id={rid!r}, offset=2)" in err.value.details()
    assert unary_err.value.code() == grpc.StatusCode.UNAVAILABLE and has_retry_info(unary_err.value)
    assert f"GetResult(request_id={unary_rid!r})" in unary_err.value.details()
    assert state(store, rid) == state(store, unary_rid) == "QUEUED"  # not cancelled: the clients did not leave
    resumed = gen.StreamResult(gen_pb.StreamResultRequest(request_id=rid, offset=2), metadata=CLIENT,
                               timeout=CALL_TIMEOUT_S)
    assert next(resumed).request_id == rid
    play_worker(store, rid, 2, 2, end=True)
    rest = list(resumed)
    assert streamed(rest)[0] == [2, 3]
    assert rest[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    for r in (rid, unary_rid):
        gen.Cancel(gen_pb.CancelRequest(request_id=r), metadata=CLIENT)


def test_a_client_that_leaves_still_cancels_its_request(bare, gen, store):
    stream = gen.GenerateStream(gen_pb.GenerateRequest(prompt="leaving", request_id="leave-1"), metadata=CLIENT,
                                timeout=CALL_TIMEOUT_S)
    rid = next(stream).request_id
    stream.cancel()
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while state(store, rid) != "CANCELLED":
        assert time.monotonic() < deadline, state(store, rid)
        time.sleep(0.02)
    assert store.hget(f"pdq:req:{rid}", "error") == b"cancelled by client disconnected"


# -- broken input ---------------------------------------------------------------------------


def string_fields(desc, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(path for the error message, attribute path) of every string field of a message type,
    nested messages included (a repeated field as its first element)."""
    out = []
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_STRING:
            path = f"{prefix}{f.name}[0]" if f.is_repeated else f"{prefix}{f.name}"
            out.append((path, [f.name]))
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated:
            out += [(p, [f.name, *attrs]) for p, attrs in string_fields(f.message_type, f"{prefix}{f.name}.")]
    return out


def with_mark(cls, attrs: list[str]) -> bytes:
    msg = cls()
    target = msg
    for name in attrs[:-1]:
        target = getattr(target, name)
    field = target.DESCRIPTOR.fields_by_name[attrs[-1]]
    if field.is_repeated:
        getattr(target, attrs[-1]).append(MARK)
    else:
        setattr(target, attrs[-1], MARK)
    raw = msg.SerializeToString()
    assert raw.count(MARK.encode()) == 1
    return raw.replace(MARK.encode(), b"PDQ\xffARK")


def broken_calls() -> list[tuple[str, str, bytes, str]]:
    """(service, method, request bytes, what the error must name) for every RPC of both services:
    invalid UTF-8 in each of its string fields, and bytes that are no message at all."""
    from google.protobuf import message_factory

    out = []
    for service in (GENERATION, OPERATOR):
        for method in service.methods:
            cls = message_factory.GetMessageClass(method.input_type)
            for path, attrs in string_fields(method.input_type):
                out.append((service.full_name, method.name, with_mark(cls, attrs), f"{path}: is not valid UTF-8"))
            out.append((service.full_name, method.name, b"\xff\xff\xff", f"not a valid {method.input_type.name}"))
    return out


def test_broken_input_to_every_rpc_is_invalid_argument_naming_the_field(bare, channel):
    cases = broken_calls()
    assert {"prompt: is not valid UTF-8", "request_id: is not valid UTF-8", "tier: is not valid UTF-8",
            "sampling.stop[0]: is not valid UTF-8", "tenant: is not valid UTF-8"} <= {c[3] for c in cases}
    for service, method, raw, words in cases:
        streaming = method in ("GenerateStream", "StreamResult")
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(f"/{service}/{method}", request_serializer=None, response_deserializer=None)
        metadata = ADMIN if service.endswith("Operator") else CLIENT
        code, err = outcome(lambda: call(raw, metadata=metadata, timeout=CALL_TIMEOUT_S))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, words, code, err and err.details())
        assert words in err.details(), (method, err.details())
    assert bare.dead_child() is None


async def submit_flood(target: str, key: str, n: int) -> list[grpc.aio.AioRpcError | None]:
    """n Submits at once (over a few channels): None for each accepted one, else its error."""
    channels = [grpc.aio.insecure_channel(target) for _ in range(4)]
    stubs = [gen_grpc.GenerationStub(ch) for ch in channels]
    metadata = (("authorization", f"Bearer {key}"),)

    async def one(i: int):
        try:
            await stubs[i % 4].Submit(gen_pb.GenerateRequest(prompt=f"flood {i}"), metadata=metadata,
                                      timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return err
        return None

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for ch in channels:
            await ch.close()


def test_a_flood_of_submits_is_accepted_and_refused_only_at_the_queue_bound(bare, op):
    got = asyncio.run(submit_flood(bare.target, KEYS["acme"], 1000))
    assert [e for e in got if e is not None] == []  # all 1,000 accepted: no "scheduler unreachable"
    op.SetTenantPolicy(op_pb.TenantPolicy(tenant="globex", weight=2.0, max_queued=300), metadata=ADMIN)
    try:
        got = asyncio.run(submit_flood(bare.target, KEYS["globex"], 500))
    finally:
        op.SetTenantPolicy(op_pb.TenantPolicy(tenant="globex", weight=2.0), metadata=ADMIN)
        for tenant in ("acme", "globex"):
            op.CancelTenant(op_pb.CancelTenantRequest(tenant=tenant), metadata=ADMIN)
    refused = [e for e in got if e is not None]
    assert len(refused) == 200  # exactly the ones past the bound
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and has_retry_info(err), err.details()
        assert "TENANT_QUEUE_FULL" in err.details()


def test_a_stopping_gateway_ends_its_streams_unavailable_and_leaves_their_requests_alone(bare, gen, store):
    # last in this module: it stops the module's gateway
    stream = gen.GenerateStream(gen_pb.GenerateRequest(prompt="outlive the gateway", request_id="stop-1"),
                                metadata=CLIENT, timeout=CALL_TIMEOUT_S)
    rid = next(stream).request_id
    gateway = next(c for c in bare.children if c.name == "gateway")
    gateway.process.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as err:
        next(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and has_retry_info(err.value), err.value.details()
    assert "gateway is stopping" in err.value.details() and "StreamResult" in err.value.details()
    assert gateway.process.wait(CALL_TIMEOUT_S) == 0
    assert state(store, rid) == "QUEUED"
