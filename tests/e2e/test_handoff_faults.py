"""P/D hand-off failures fail closed, and a request moves between decode workers intact."""

import signal
import time

import grpc
import pytest
import redis

from pdq.client import Client
from pdq.ops.up import Cluster
from tests.observability.test_metrics import scrape, value
from tests.streams import streamed, until_tokens


@pytest.fixture(scope="module", params=["grpc", "tcp"])
def faulty(request):
    # the prefill worker corrupts its first 4 KV hand-offs; a stopping worker waits 0.3 s at most;
    # hand-offs go over PushKV, then (second round) over the decode workers' TCP data plane
    env = {"PDQ_FAULTS": "kv_corrupt=4", "PDQ_GRACE_S": "0.3", "PDQ_KV_TRANSPORT": request.param}
    with Cluster(model="builtin", port=0, decode=2, extra_env=env) as c:
        c.kv_transport = request.param
        yield c


def record(c: Cluster, rid: str) -> dict:
    r = redis.Redis.from_url(c.redis_url)
    try:
        return {k.decode(): v.decode() for k, v in r.hgetall(f"pdq:req:{rid}").items() if k != b"spec"}
    finally:
        r.close()


def test_corrupt_handoffs_never_produce_tokens_and_retries_are_bounded(faulty):
    with Client(faulty.target) as c:
        with pytest.raises(grpc.RpcError) as err:  # attempts 1-3 corrupted: FAILED, never garbled
            c.generate("first", max_tokens=5, ignore_eos=True, request_id="corrupt-a")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV hand-off" in err.value.details() and "checksum" in err.value.details()
        rid_a = c.get_result("corrupt-a").request_id
        rec = record(faulty, rid_a)
        assert rec["state"] == "FAILED" and rec["n_out"] == "1"  # only the prefill's first token was streamed

        ok = c.generate("second", max_tokens=5, ignore_eos=True, request_id="corrupt-b")  # 4th corrupted, 5th fine
        assert len(ok.token_ids) == 5
        assert record(faulty, ok.request_id)["attempts"] == "2"
        assert ok.token_ids == c.generate("second", max_tokens=5, ignore_eos=True).token_ids


def test_hand_offs_went_over_the_configured_transport(faulty):
    samples = scrape(next(ch for ch in faulty.children if ch.name == "prefill-0").metrics_url(faulty.host))
    assert value(samples, "pdq_kv_transfer_seconds_count", outcome="error", transport=faulty.kv_transport) == 4
    assert value(samples, "pdq_kv_transfer_seconds_count", outcome="ok", transport=faulty.kv_transport) >= 2
    other = {"grpc": "tcp", "tcp": "grpc"}[faulty.kv_transport]
    assert value(samples, "pdq_kv_transfer_seconds_count", transport=other) == 0


def test_failed_handoffs_release_their_kv_reservations(faulty):
    # runs after the corrupt hand-offs above: each failed attempt's reserved slot must be given
    # back at once (a leak would only come back when the 30 s reservation timeout expires)
    r = redis.Redis.from_url(faulty.redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + 5.0
        while True:
            workers = [r.hgetall(f"pdq:worker:{w}") for w in r.zrange("pdq:workers:decode", 0, -1)]
            leaked = [(w["address"], w["free_slots"], w["capacity"]) for w in workers
                      if w.get("free_slots") != w.get("capacity")]
            if workers and not leaked:
                break
            assert time.monotonic() < deadline, f"KV reservations not released: {leaked}"
            time.sleep(0.05)
    finally:
        r.close()


def test_request_moves_to_another_decode_worker_when_its_worker_stops(faulty):
    with Client(faulty.target) as c:
        expected = c.generate("migrate me", max_tokens=200, ignore_eos=True).token_ids
        stream = c.generate_stream("migrate me", max_tokens=200, ignore_eos=True)
        rid = next(stream).request_id
        seen = until_tokens(stream, 5)
        address = record(faulty, rid)["decode_worker"]
        victim = next(ch for ch in faulty.children if address.endswith(f":{ch.port}"))
        victim.process.send_signal(signal.SIGTERM)  # its sequences go back to the scheduler
        seen += [m for m in stream]
        indices, tokens = streamed(seen)
        assert indices == list(range(200))  # every index exactly once
        assert tokens == expected  # same greedy output as uninterrupted
        rec = record(faulty, rid)
        assert rec["state"] == "COMPLETED" and rec["decode_worker"] != address
        victim.process.wait(30)
