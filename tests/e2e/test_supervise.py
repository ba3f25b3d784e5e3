"""A supervised cluster heals itself: a process killed with SIGKILL (a decode worker, the
gateway, the private Redis server) is started again on its port under its worker id, and the
requests it was serving still complete. With two schedulers, killing the leading one loses
nothing and no submit fails: the standby takes over.

The cluster uses the `tiny` built-in model, a durable private Redis, short heartbeats and worker
timeouts, and decode steps slowed to 10 ms by the fault switch, so that a request is still
decoding when its worker is killed. Supervision runs in this (the main) thread, through
`Cluster.supervise_until`, as `pdq up` runs it.
"""

import os
import time

import grpc
import pytest
import redis

from pdq.client import Client
from pdq.ops.up import Cluster

FAST_FAILOVER = {"PDQ_HEARTBEAT_S": "0.25", "PDQ_WORKER_TIMEOUT_S": "1.5", "PDQ_GRACE_S": "0.3"}
TOKENS = 150


@pytest.fixture(scope="module")
def cluster():
    env = {**FAST_FAILOVER, "PDQ_FAULTS": "decode_step_delay_ms=10"}
    with Cluster(model="builtin:tiny", port=0, prefill=1, decode=1, schedulers=2, durable=True, auth=False,
                 metrics_port=-1, extra_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def rdb(cluster):
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    yield r
    r.close()


@pytest.fixture(scope="module")
def expected(cluster):
    with Client(cluster.target) as c:
        return c.generate("heal me", max_tokens=TOKENS, ignore_eos=True).token_ids


def wait_for(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)
    return value


def results(client: Client, rids: list[str], timeout_s: float = 180.0) -> list:
    deadline, out = time.monotonic() + timeout_s, []
    for rid in rids:
        while not (r := client.get_result(rid, wait_ms=5_000)).done:
            assert time.monotonic() < deadline, f"{rid} still {r.state} after {timeout_s}s"
        out.append(r)
    return out


def test_a_killed_decode_worker_comes_back_under_its_id_and_its_requests_complete(cluster, rdb, expected):
    with Client(cluster.target) as client:
        rids = [client.submit("heal me", max_tokens=TOKENS, ignore_eos=True) for _ in range(3)]
        decoding = wait_for("a request decoding", lambda: [rid for rid in rids
                                                           if rdb.hget(f"pdq:req:{rid}", "state") == "DECODING"])
        before = cluster.restarts["decode-0"]
        old = cluster.kill("decode-0").process.pid
        assert not cluster.serving("decode-0")
        cluster.supervise_until(lambda: cluster.restarts["decode-0"] == before + 1 and cluster.serving("decode-0"),
                                what="decode-0 restarted and SERVING")
        assert cluster.child("decode-0").process.pid != old
        done = results(client, rids)
    assert [(r.state, list(r.result.token_ids)) for r in done] == [("COMPLETED", list(expected))] * 3
    assert int(rdb.hget(f"pdq:req:{decoding[0]}", "attempts")) >= 2  # it was taken back from the dead worker
    assert rdb.exists(f"pdq:worker:decode-0-{os.getpid()}")  # registered again under its id


def test_a_killed_gateway_comes_back_on_the_same_port(cluster, expected):
    before = cluster.restarts["gateway"]
    cluster.kill("gateway")
    with Client(cluster.target) as client, pytest.raises(grpc.RpcError) as err:
        client.generate("heal me", max_tokens=2, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # down, and nothing supervises yet
    cluster.supervise_until(lambda: cluster.restarts["gateway"] == before + 1 and cluster.serving("gateway"),
                            what="the gateway restarted and SERVING")
    with Client(cluster.target) as client:  # the same address as before
        assert client.generate("heal me", max_tokens=TOKENS, ignore_eos=True).token_ids == expected


def test_a_killed_durable_redis_comes_back_on_its_port_with_its_data(cluster, rdb, expected):
    with Client(cluster.target) as client:
        rid = client.submit("heal me", max_tokens=4, ignore_eos=True)
        assert results(client, [rid])[0].state == "COMPLETED"
    before = cluster.restarts["redis"]
    cluster.kill("redis", down_s=1.0)
    assert not cluster.serving("redis")
    cluster.supervise_until(lambda: cluster.restarts["redis"] == before + 1 and cluster.serving("redis"),
                            what="Redis restarted")
    assert rdb.hget(f"pdq:req:{rid}", "state") == "COMPLETED"  # on the AOF, on the same port
    with Client(cluster.target) as client:
        rid = client.submit("heal me", max_tokens=TOKENS, ignore_eos=True)
        assert list(results(client, [rid])[0].result.token_ids) == list(expected)


def test_killing_the_leading_scheduler_mid_load_loses_nothing_and_no_submit_fails(cluster, rdb, expected):
    ids = {name: f"{name}-{os.getpid()}" for name in ("scheduler", "scheduler-1")}
    wait_for("a leader", lambda: rdb.get("pdq:leader"))
    # the first to start led; after the Redis restart above either may have taken the lease again
    leading = next(name for name, worker in ids.items() if worker == rdb.get("pdq:leader").split()[1])
    standby = next(name for name in ids if name != leading)
    second = ids[standby]
    epoch = int(rdb.get("pdq:leader:epoch"))
    with Client(cluster.target) as client:
        rids = [client.submit("heal me", max_tokens=TOKENS, ignore_eos=True) for _ in range(3)]
        wait_for("a request decoding", lambda: any(rdb.hget(f"pdq:req:{rid}", "state") == "DECODING" for rid in rids))
        cluster.kill(leading)
        # the gateway sends each submit to the standby now; it queues them, and dispatches them once it leads
        rids += [client.submit("heal me", max_tokens=TOKENS, ignore_eos=True) for _ in range(3)]
        wait_for("the standby leading", lambda: (rdb.get("pdq:leader") or "0 none").split()[1] == second)
        done = results(client, rids)
    assert [(r.state, list(r.result.token_ids)) for r in done] == [("COMPLETED", list(expected))] * 6
    assert int(rdb.get("pdq:leader:epoch")) == epoch + 1
    cluster.supervise_until(lambda: cluster.serving(leading), what="the killed scheduler back")
    assert rdb.get("pdq:leader").split()[1] == second  # back as a standby: the lease stays where it is
