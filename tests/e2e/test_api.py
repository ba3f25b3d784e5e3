"""The public API beyond Generate: auth, async submit + fetch, resumable streams, the asyncio client."""

import asyncio
import time

import grpc
import pytest

from pdq.client import AsyncClient, Client
from pdq.v1 import generation_pb2 as gen_pb
from tests.e2e.conftest import KEYS
from tests.streams import streamed


@pytest.mark.parametrize("key", [None, "not-a-real-key-123"])
def test_missing_or_unknown_key_is_unauthenticated(cluster, monkeypatch, key):
    monkeypatch.delenv("PDQ_API_KEY", raising=False)
    with Client(cluster.target, api_key=key) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hi", max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_submit_then_get_result_long_polls_to_the_end(client):
    rid = client.submit("fetch me later", max_tokens=12, ignore_eos=True)
    first = client.get_result(rid)
    assert first.request_id == rid and first.state  # answers at once, whatever the state
    done = client.get_result(rid, wait_ms=30_000)
    assert done.done and done.state == "COMPLETED"
    assert len(done.result.token_ids) == 12 and done.result.usage.completion_tokens == 12
    assert done.result.finish_reason == gen_pb.FINISH_REASON_LENGTH
    direct = client.generate("fetch me later", max_tokens=12, ignore_eos=True)
    assert done.result.token_ids == direct.token_ids  # greedy: the same tokens


def test_submit_by_client_request_id_is_idempotent_and_fetchable_by_it(client):
    a = client.submit("same key", max_tokens=3, request_id="job-42")
    b = client.submit("same key", max_tokens=3, request_id="job-42")
    assert a == b
    assert client.get_result("job-42", wait_ms=30_000).request_id == a


def test_a_request_id_reused_for_different_content_is_already_exists_and_the_first_request_keeps_it(client, cluster):
    from pdq.client import OperatorClient

    rid = client.submit("first content", max_tokens=3, request_id="reuse-1")
    again = client.submit("first content", max_tokens=3, request_id="reuse-1")  # a true retry
    assert again == rid
    for changed in (dict(prompt="other content", max_tokens=3), dict(prompt="first content", max_tokens=4),
                    dict(prompt="first content", max_tokens=3, tier="batch")):
        with pytest.raises(grpc.RpcError) as err:
            client.submit(changed.pop("prompt"), request_id="reuse-1", **changed)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'reuse-1'" in err.value.details() and "new request_id" in err.value.details()
    done = client.get_result("reuse-1", wait_ms=30_000)
    assert done.request_id == rid and done.client_request_id == "reuse-1" and done.state == "COMPLETED"
    with OperatorClient(cluster.target, api_key=KEYS["ops"]) as op:
        assert op.get_request(rid).client_request_id == "reuse-1"


def test_stream_result_resumes_from_an_offset_without_repeats(client):
    rid = client.submit("resume me", max_tokens=10, ignore_eos=True)
    msgs = list(client.stream_result(rid, offset=6))
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    full = client.get_result(rid, wait_ms=10_000).result.token_ids
    assert streamed(msgs) == ([6, 7, 8, 9], list(full[6:]))
    rid = client.submit("resume me in groups", max_tokens=30, ignore_eos=True, stream_interval=4)
    full = client.get_result(rid, wait_ms=30_000).result.token_ids
    # written in groups of up to 4 (index 3 inside one), read from the offset on: none before 3, none twice
    assert streamed(client.stream_result(rid, offset=3)) == (list(range(3, 30)), list(full[3:]))


def test_another_tenants_request_is_not_found(client, other_tenant):
    rid = client.submit("mine", max_tokens=2)
    for call in (lambda: other_tenant.get_result(rid), lambda: other_tenant.cancel(rid),
                 lambda: list(other_tenant.stream_result(rid))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert client.get_result(rid, wait_ms=10_000).done


def test_tenant_comes_from_the_key(client, other_tenant, store_client):
    rid = other_tenant.submit("who am i", max_tokens=2)
    assert store_client.hget(f"pdq:req:{rid}", "tenant") == b"globex"


def test_errors_carry_typed_details(client):
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    with pytest.raises(grpc.RpcError) as err:
        client.generate(list(range(3, 2100)), max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(err.value)
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == "PROMPT_TOO_LONG" and info.metadata["field"] == "prompt_token_ids"


def test_tenant_policies_of_the_key_file_reach_the_scheduler(store_client):
    assert float(store_client.hget("pdq:tenant:globex", "weight")) == 2.0


def test_the_asyncio_client_streams_what_the_sync_one_gets_and_cancels_on_close(cluster, client, store_client):
    want = client.generate("async twin", max_tokens=12, ignore_eos=True)

    async def main():
        async with AsyncClient(cluster.target, api_key=KEYS["acme"]) as c:
            msgs = [m async for m in c.generate_stream("async twin", max_tokens=12, ignore_eos=True)]
            stream = c.generate_stream("left early", max_tokens=1500, ignore_eos=True)
            rid = (await anext(stream)).request_id
            await anext(stream)  # a token: it is decoding
            await stream.aclose()  # closing the stream cancels the request
            submitted = await c.submit("queued then cancelled", max_tokens=1500, ignore_eos=True)
            return msgs, rid, await c.generate("unary", max_tokens=3, ignore_eos=True), await c.cancel(submitted)

    msgs, rid, unary, cancelled = asyncio.run(main())
    assert cancelled == "CANCELLED"
    assert streamed(msgs)[1] == want.token_ids and "".join(m.text for m in msgs) == want.text
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH and unary.completion_tokens == 3
    deadline = time.monotonic() + 30
    while store_client.hget(f"pdq:req:{rid}", "state") != b"CANCELLED":
        assert time.monotonic() < deadline, "the closed stream's request was not cancelled"
        time.sleep(0.05)
