"""P/D disaggregation at scale, on real processes: a decode worker killed mid-stream (kill -9), a
worker joining under load, a full decode pool, and KV reservations released on every failure.

The cluster uses the `tiny` built-in model, short heartbeat and worker timeouts (a dead worker
is reaped in ~1.5 s), and decode steps slowed to 10 ms by the fault switch so that a stream is
still running when a worker is killed and a queue builds up.
"""

import signal
import threading
import time

import grpc
import pytest
import redis

from pdq.client import Client
from pdq.ops.up import Child, Cluster
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc
from tests.streams import streamed, until_tokens

FAST_FAILOVER = {"PDQ_HEARTBEAT_S": "0.25", "PDQ_WORKER_TIMEOUT_S": "1.5", "PDQ_GRACE_S": "0.3"}
SLOTS = 2  # decode slots per worker (PDQ_MAX_BATCH_SIZE; the scheduler's prefill batches are as small)


@pytest.fixture(scope="module")
def cluster():
    env = {**FAST_FAILOVER, "PDQ_MAX_BATCH_SIZE": str(SLOTS), "PDQ_FAULTS": "decode_step_delay_ms=10"}
    with Cluster(model="builtin:tiny", port=0, prefill=1, decode=2, auth=False, extra_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def rdb(cluster):
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield r
    r.close()


def record(rdb: redis.Redis, rid: str) -> dict:
    fields = [f for f in rdb.hkeys(f"pdq:req:{rid}") if f != "spec"]  # spec is protobuf bytes
    return dict(zip(fields, rdb.hmget(f"pdq:req:{rid}", fields))) if fields else {}


def wait_for(what: str, check, timeout_s: float = 30.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(every_s)


def child_at(cluster: Cluster, address: str) -> Child:
    return next(ch for ch in cluster.children if address.endswith(f":{ch.port}"))


def decode_children(cluster: Cluster) -> list[Child]:
    return [ch for ch in cluster.children if ch.name.startswith("decode-") and ch.process.poll() is None]


def test_kill_9_decode_worker_mid_stream_resumes_elsewhere_exactly_once(cluster, rdb):
    prompt, n = "the quick brown fox jumps over", 120
    with Client(cluster.target) as c:
        expected = c.generate(prompt, max_tokens=n, ignore_eos=True)
        assert len(expected.token_ids) == n
        stream = c.generate_stream(prompt, max_tokens=n, ignore_eos=True)
        seen = [next(stream)]
        rid = seen[0].request_id
        seen += until_tokens(stream, 5)  # tokens are arriving from a decode worker
        address = wait_for("the decode worker in the record", lambda: record(rdb, rid).get("decode_worker"))
        assert record(rdb, rid)["state"] == "DECODING"
        victim = child_at(cluster, address)
        victim.process.send_signal(signal.SIGKILL)  # no goodbye: only its missing heartbeats tell
        victim.process.wait(10)
        seen += list(stream)
    indices, tokens = streamed(seen)
    assert indices == list(range(n))  # every index exactly once, in order
    assert tokens == list(expected.token_ids)  # same greedy output
    assert "".join(m.text for m in seen) == expected.text
    rec = record(rdb, rid)
    assert rec["state"] == "COMPLETED" and rec["decode_worker"] != address
    assert int(rec["attempts"]) == 2  # resumed once, by re-prefilling prompt + streamed tokens
    # the dead worker was reaped from the registry
    wait_for("the dead worker to leave the registry",
             lambda: all(rdb.hget(f"pdq:worker:{w}", "address") != address for w in rdb.zrange("pdq:workers:decode", 0, -1)))


def test_full_decode_pool_makes_requests_wait_not_fail(cluster, rdb):
    slots = SLOTS * len(decode_children(cluster))
    n = 3 * slots + 1
    with Client(cluster.target) as c:
        results: list = [None] * n

        def run(i: int) -> None:
            results[i] = c.generate(f"pool {i}", max_tokens=20, ignore_eos=True, timeout=120)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert all(r is not None and len(r.token_ids) == 20 for r in results)  # none failed or was dropped
    recs = [record(rdb, r.request_id) for r in results]
    assert all(rec["state"] == "COMPLETED" and rec["attempts"] == "1" for rec in recs)  # waited, never retried
    # more requests than slots: some were dispatched only after others had finished and freed a slot
    first_done = min(int(rec["finished_ms"]) for rec in recs)
    assert sum(int(rec["dispatched_ms"]) >= first_done for rec in recs) >= n - slots


def test_worker_joining_under_load_gets_work(cluster, rdb):
    rids: list[str] = []
    stop = threading.Event()
    with Client(cluster.target) as c:
        def feed() -> None:  # keeps a backlog of queued requests until the new worker is up
            while not stop.is_set():
                if sum(rdb.hget(f"pdq:req:{rid}", "state") == "QUEUED" for rid in rids) < 2 * SLOTS:
                    rids.append(c.submit(f"join {len(rids)}", max_tokens=40, ignore_eos=True))
                else:
                    stop.wait(0.02)

        feeder = threading.Thread(target=feed)
        feeder.start()
        try:
            wait_for("a backlog", lambda: sum(rdb.hget(f"pdq:req:{r}", "state") == "QUEUED" for r in list(rids)) > 0)
            joined = cluster.add_worker("decode")
        finally:
            stop.set()
            feeder.join()
        queued = sum(rdb.hget(f"pdq:req:{rid}", "state") == "QUEUED" for rid in rids)
        results = [c.get_result(rid, wait_ms=60_000) for rid in rids]
    assert all(r.done and len(r.result.token_ids) == 40 for r in results)
    served = [record(rdb, rid)["decode_worker"] for rid in rids]
    mine = sum(a.endswith(f":{joined.port}") for a in served)
    assert mine > 0, f"the joining worker served none of {len(rids)} requests ({queued} queued when it joined)"


def decode_stub(child: Child, cluster: Cluster) -> tuple[grpc.Channel, pb_grpc.DecodeWorkerStub]:
    channel = grpc.insecure_channel(f"{cluster.host}:{child.port}")
    return channel, pb_grpc.DecodeWorkerStub(channel)


def worker_id_of(rdb: redis.Redis, child: Child) -> str | None:
    """The registry id of a worker, None until it registered (its first heartbeat follows SERVING)."""
    return next((w for w in rdb.zrange("pdq:workers:decode", 0, -1)
                 if (rdb.hget(f"pdq:worker:{w}", "address") or "").endswith(f":{child.port}")), None)


def test_unused_reservation_expires_and_frees_its_slot(cluster, rdb):
    # a worker of its own with a short hold timeout; its slots are taken by Reserve calls that
    # never get a PushKV (as when the scheduler dies between Reserve and dispatch)
    child = cluster.add_worker("decode", "--reservation-timeout-s", "1", "--max-batch-size", "2")
    wid = wait_for("the new worker's registry entry", lambda: worker_id_of(rdb, child))
    channel, stub = decode_stub(child, cluster)
    with channel:
        # other traffic may reserve here too; take every free slot by hand
        held = 0
        for i in range(2):
            held += stub.Reserve(pb.ReserveRequest(request_id=f"orphan-{i}", tokens=10), timeout=5).granted
        assert held >= 1
        free = lambda: int(rdb.hget(f"pdq:worker:{wid}", "free_slots") or -1)  # noqa: E731
        wait_for("free_slots to drop", lambda: free() < 2, timeout_s=5)
        # no further call reaches the worker: its heartbeat must notice the expiry by itself
        wait_for("the orphaned holds to expire", lambda: free() == 2, timeout_s=10)
        with pytest.raises(grpc.RpcError) as err:  # an expired hold accepts no hand-off
            stub.PushKV(iter(_tiny_handoff("orphan-0")), timeout=5)
        assert err.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS)


def _tiny_handoff(rid: str):
    """A well-formed hand-off for the tiny model (2 layers, 2 KV heads, head_dim 32), one token."""
    import torch

    from pdq.transport import kv_transfer

    layers = [(torch.zeros(2, 1, 32), torch.zeros(2, 1, 32)) for _ in range(2)]
    header = pb.KVHeader(spec=pb.RequestSpec(request_id=rid), epoch=1, generated_token_ids=[1])
    return kv_transfer.encode(header, layers)
