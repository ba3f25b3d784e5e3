"""Workers under Redis faults, on real processes: a decode worker rides dropped connections and a
Redis crash and restart mid-generation (no attempt lost, no token missing or repeated), still
hears an operator's deadline move after its pub/sub connection was killed, and goes down
(NOT_SERVING, exit status 1) when Redis stays away longer than --redis-outage-s.

The clusters use the `tiny` built-in model and decode steps slowed to 20 ms by the fault switch,
so that a generation is running when the fault comes; Redis is a server of the test's own, so
that the test can drop its connections, freeze, kill and restart it (from this thread: its
children die with the thread that spawned them).
"""

import signal
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.client import Client
from pdq.ops.redis_server import RedisServer
from pdq.state.request import State
from pdq.state.store import SyncStore, now_ms
from pdq.ops.up import Child, Cluster

ENV = {"PDQ_FAULTS": "decode_step_delay_ms=20", "PDQ_GRACE_S": "0.5"}
PROMPTS = ["the quick brown fox", "lorem ipsum dolor sit amet", "def add(a, b):"]


def wait_for(what: str, check, timeout_s: float = 60.0, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except redis.ConnectionError:  # Redis restarting
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(every_s)


def decode_child(cluster: Cluster) -> Child:
    (child,) = [c for c in cluster.children if c.name.startswith("decode-")]
    return child


def record(r: redis.Redis, rid: str) -> dict:
    return {k.decode(): v.decode() for k, v in r.hgetall(f"pdq:req:{rid}").items() if k != b"spec"}


def stream(r: redis.Redis, rid: str) -> list[tuple[int, int]]:
    """(index, token id) of every token in the request's output stream, in stream order."""
    out = []
    for _, entry in r.xrange(f"pdq:req:{rid}:out"):
        if b"i" in entry:
            first = int(entry[b"i"])
            out += [(first + k, int(t)) for k, t in enumerate(entry[b"t"].split(b","))]
    return out


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    server = RedisServer(directory=str(tmp_path_factory.mktemp("redis")), durable=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(own_redis):
    with Cluster(model="builtin:tiny", port=0, redis_url=own_redis.url, auth=False, metrics_port=-1,
                 extra_env=ENV) as c:
        yield c


@pytest.fixture
def r(own_redis):
    client = redis.Redis.from_url(own_redis.url)
    yield client
    client.close()


def test_a_decode_worker_still_takes_a_deadline_move_after_its_pubsub_connection_was_killed(cluster, r):
    """A request with a 6 s deadline needs ~9 s; an operator moves the deadline right after the
    worker's listener lost its connection. The worker resubscribes (and catches up on what it
    missed meanwhile), so the request completes instead of timing out at the old deadline."""
    child = decode_child(cluster)
    with Client(cluster.target) as c:
        rid = c.submit(PROMPTS[0], max_tokens=450, ignore_eos=True, timeout_ms=6000)
    wait_for("tokens from the decode worker", lambda: int(record(r, rid).get("n_out", 0)) >= 3)
    (listener,) = [cl for cl in r.client_list(_type="pubsub") if cl["name"] == f"pdq-cancels-{child.process.pid}"]
    r.client_kill_filter(_id=listener["id"])
    assert SyncStore(r).set_deadline(rid, now_ms() + 120_000) == State.DECODING
    wait_for("the request to end", lambda: record(r, rid)["state"] in {"COMPLETED", "TIMED_OUT", "FAILED"})
    rec = record(r, rid)
    assert (rec["state"], rec["n_out"], rec["attempts"]) == ("COMPLETED", "450", "1")


def test_a_decode_worker_rides_dropped_connections_and_a_redis_crash_mid_generation(cluster, own_redis, r):
    """Every connection dropped (CLIENT KILL TYPE normal), then Redis frozen with the worker's
    step unanswered, killed and restarted from its AOF: the worker keeps its sequences, and
    each stream is whole (no gap, no repeat) and equal to a fault-free run, in its first
    attempt. The worker process stays up."""
    n = 150
    with Client(cluster.target) as c:
        reference = [list(c.generate(p, max_tokens=n, ignore_eos=True).token_ids) for p in PROMPTS]
        rids = [c.submit(p, max_tokens=n, ignore_eos=True) for p in PROMPTS]
    wait_for("tokens from the decode worker", lambda: all(int(record(r, x).get("n_out", 0)) >= 3 for x in rids))
    for _ in range(3):  # each round kills at least one connection, once the cluster has reconnected
        wait_for("a connection of the cluster to kill", lambda: r.client_kill_filter(_type="normal", skipme=True) >= 1)
    assert all(record(r, x)["state"] == "DECODING" for x in rids)  # still generating
    own_redis.process.send_signal(signal.SIGSTOP)  # the worker's next step is sent and never answered
    time.sleep(0.5)
    own_redis.process.send_signal(signal.SIGKILL)
    own_redis.process.wait()
    own_redis.start()  # same port, same AOF
    r.connection_pool.disconnect()
    wait_for("the requests to complete", lambda: all(record(r, x)["state"] == "COMPLETED" for x in rids))
    for rid, expected in zip(rids, reference):
        rec = record(r, rid)
        assert (rec["attempts"], rec["n_out"]) == ("1", str(n))
        assert stream(r, rid) == list(enumerate(expected))
    assert decode_child(cluster).process.poll() is None


def test_a_redis_outage_longer_than_redis_outage_s_takes_a_decode_worker_down_with_exit_1_and_not_serving(tmp_path):
    server = RedisServer(directory=str(tmp_path)).start()
    try:
        with Cluster(model="builtin:tiny", port=0, redis_url=server.url, auth=False, metrics_port=-1,
                     extra_env={**ENV, "PDQ_REDIS_OUTAGE_S": "1"}) as cluster:
            child = decode_child(cluster)
            r = redis.Redis.from_url(server.url)
            with Client(cluster.target) as c:
                rid = c.submit(PROMPTS[0], max_tokens=2000, ignore_eos=True)
            wait_for("tokens from the decode worker", lambda: int(record(r, rid).get("n_out", 0)) >= 3)
            r.close()
            server.stop()  # for good: the worker's next write cannot be done within 1 s
            seen = set()
            with grpc.insecure_channel(f"{cluster.host}:{child.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                deadline = time.monotonic() + 60
                while child.process.poll() is None and time.monotonic() < deadline:
                    try:
                        seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
                    except grpc.RpcError:
                        pass  # the port closed: it is exiting
                    time.sleep(0.02)
            assert child.process.wait(30) == 1
            assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    finally:
        server.stop()
