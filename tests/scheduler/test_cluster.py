"""The scheduler in a real cluster (every role its own process, the built-in tiny model): cancel
while queued and while decoding, a queued request's deadline, overflow with a retry hint through
the gateway, and crashes: a decode worker and the scheduler killed with SIGKILL."""

import os
import signal
import sys
import time

import grpc
import pytest
import redis
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from pdq.client import Client
from pdq.ops.child import spawn
from pdq.ops.up import Cluster
from tests.streams import streamed, until_tokens

SLOTS = 2  # sequences per decode worker (and requests per prefill batch)


@pytest.fixture(scope="module")
def cluster():
    env = {"PDQ_MAX_BATCH_SIZE": str(SLOTS), "PDQ_TENANT_MAX_QUEUED": "3", "PDQ_WORKER_TIMEOUT_S": "2",
           "PDQ_DISPATCH_INTERVAL_MS": "10", "PDQ_FAULTS": "decode_step_delay_ms=10", "PDQ_GRACE_S": "0.5"}
    with Cluster(model="builtin:tiny", port=0, prefill=1, decode=2, metrics_port=-1, extra_env=env) as c:
        yield c


@pytest.fixture
def r(cluster):
    client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def client(cluster):
    with Client(cluster.target, api_key=cluster.client_key) as c:
        yield c


def state(r, rid):
    return r.hget(f"pdq:req:{rid}", "state") or ""


def record(r, rid, *fields):
    return dict(zip(fields, r.hmget(f"pdq:req:{rid}", fields)))


def wait(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


def fill_decode_slots(client, r, n=2 * SLOTS):
    """Starts n long requests, one after the other (the queue holds only 3 of a tenant's
    requests), and waits until they all decode. -> their ids."""
    rids = []
    for i in range(n):
        rids.append(client.submit([65 + i] * 8, max_tokens=1900, ignore_eos=True))
        wait(lambda: state(r, rids[-1]) != "QUEUED")
    wait(lambda: all(state(r, x) == "DECODING" for x in rids))
    return rids


def end_all(client, r, rids):
    for x in rids:
        client.cancel(x)
    wait(lambda: all(state(r, x) == "CANCELLED" for x in rids))
    wait(lambda: all(int(w["free_slots"]) == int(w["capacity"]) for w in decode_workers(r).values()))


def decode_workers(r):
    return {w: r.hgetall(f"pdq:worker:{w}") for w in r.zrange("pdq:workers:decode", 0, -1)
            if r.hget(f"pdq:worker:{w}", "address")}


def test_cancel_while_queued_and_while_decoding(client, r):
    running = fill_decode_slots(client, r)
    queued = client.submit("wait for me", max_tokens=8)
    time.sleep(0.2)
    assert state(r, queued) == "QUEUED"
    assert client.cancel(queued) == "CANCELLED"
    assert state(r, queued) == "CANCELLED" and int(r.hget("pdq:load", "n") or 0) == 0

    victim = running[0]
    worker = next(w for w, h in decode_workers(r).items() if h["address"] == r.hget(f"pdq:req:{victim}", "decode_worker"))
    assert client.cancel(victim) == "CANCELLED"
    wait(lambda: int(r.hget(f"pdq:worker:{worker}", "free_slots")) == 1)  # its KV slot is free again
    assert client.cancel(victim) == "CANCELLED"  # idempotent
    end_all(client, r, running[1:])


def test_a_queued_request_times_out_at_its_deadline(client, r):
    running = fill_decode_slots(client, r)
    with pytest.raises(grpc.RpcError) as err:
        client.generate("too late", max_tokens=8, timeout_ms=300, request_id="queued-deadline-1")
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    rid = r.get("pdq:idem:default:queued-deadline-1")
    wait(lambda: state(r, rid) == "TIMED_OUT")
    rec = record(r, rid, "n_out", "dispatched_ms")
    assert rec == {"n_out": "0", "dispatched_ms": None}  # it never left the queue
    end_all(client, r, running)


def test_overflow_gets_resource_exhausted_with_a_retry_hint_through_the_gateway(client, r):
    running = fill_decode_slots(client, r)
    queued = [client.submit("in line", max_tokens=8) for _ in range(3)]
    with pytest.raises(grpc.RpcError) as err:
        client.submit("one too many", max_tokens=8)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("TENANT_QUEUE_FULL")
    delay = int(dict(err.value.trailing_metadata())["grpc-retry-pushback-ms"])
    retry = error_details_pb2.RetryInfo()
    assert delay >= 100 and rpc_status.from_call(err.value).details[-1].Unpack(retry)
    assert retry.retry_delay.ToMilliseconds() == delay
    end_all(client, r, running + queued)


def kill(cluster, name_or_address):
    child = next(c for c in cluster.children if c.name == name_or_address or name_or_address.endswith(f":{c.port}"))
    child.process.send_signal(signal.SIGKILL)
    child.process.wait()
    return child


def test_a_killed_decode_workers_request_finishes_on_the_other_one_intact(client, r, cluster):
    expected = client.generate("survive me", max_tokens=120, ignore_eos=True).token_ids
    stream = client.generate_stream("survive me", max_tokens=120, ignore_eos=True)
    rid = next(stream).request_id
    seen = until_tokens(stream, 5)
    address = r.hget(f"pdq:req:{rid}", "decode_worker")
    kill(cluster, address)
    seen += list(stream)
    indices, tokens = streamed(seen)
    assert indices == list(range(120))  # every index exactly once
    assert tokens == expected
    rec = record(r, rid, "state", "decode_worker", "attempts")
    assert rec["state"] == "COMPLETED" and rec["decode_worker"] != address and rec["attempts"] == "2"


def test_a_killed_scheduler_restarts_and_loses_nothing(client, r, cluster):
    rids = []
    for i in range(5):  # all accepted: each waits for room under the tenant's bound of 3 queued
        wait(lambda: int(r.hget("pdq:load", "n") or 0) < 3)
        rids.append(client.submit(f"load {i}", max_tokens=60, ignore_eos=True))
    wait(lambda: int(r.hget("pdq:load", "n") or 0) > 0 and any(state(r, x) == "DECODING" for x in rids))
    old = kill(cluster, "scheduler")
    env = dict(os.environ, PDQ_REDIS_URL=cluster.redis_url, PDQ_METRICS_PORT="-1",
               **{k: v for k, v in cluster.extra_env.items() if k != "PDQ_FAULTS"})
    old.process = spawn([sys.executable, "-m", "scheduler", "--host", cluster.host, "--port", str(old.port)],
                                   env=env)
    wait(lambda: all(state(r, x) == "COMPLETED" for x in rids), timeout_s=120)
    for x in rids:
        indices = [int(f["i"]) for _, f in r.xrange(f"pdq:req:{x}:out") if "i" in f]
        assert indices == list(range(60)), x
