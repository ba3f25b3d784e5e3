"""Workers as separate hosts: a decode worker in its own network namespace, joined to the rest of
the cluster only by a veth pair. It reaches Redis at the host's veth address, advertises its own
namespace address, and every KV hand-off crosses the veth link (nothing shares loopback).

Needs `ip netns` (root or CAP_NET_ADMIN); skipped, with the error, where the machine refuses it.
"""

import os
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.client import Client
from pdq.ops.child import spawn, stop
from pdq.ops.redis_server import RedisServer, free_port
from pdq.ops.up import Cluster


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def netns():
    """-> (namespace name, host-side address, namespace-side address)."""
    tag = uuid.uuid4().hex[:6]
    name, host_if, ns_if = f"pdq-{tag}", f"pdqh{tag}", f"pdqn{tag}"
    octet = 16 + int(tag[:2], 16) % 200  # a /24 per run, so parallel runs do not collide
    host_ip, ns_ip = f"10.{octet}.77.1", f"10.{octet}.77.2"
    made = ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"ip netns does not work here: {made.stderr.strip()}")
    try:
        for step in (["link", "add", host_if, "type", "veth", "peer", "name", ns_if],
                     ["link", "set", ns_if, "netns", name],
                     ["addr", "add", f"{host_ip}/24", "dev", host_if], ["link", "set", host_if, "up"],
                     ["-n", name, "addr", "add", f"{ns_ip}/24", "dev", ns_if],
                     ["-n", name, "link", "set", ns_if, "up"], ["-n", name, "link", "set", "lo", "up"]):
            done = ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield name, host_ip, ns_ip
    finally:
        ip("link", "del", host_if)  # removes its peer too
        ip("netns", "del", name)


def test_decode_worker_in_its_own_network_namespace_serves_requests(netns):
    name, host_ip, ns_ip = netns
    with RedisServer(host=host_ip) as rs, \
            Cluster(model="builtin:tiny", host=host_ip, port=0, decode=0, auth=False, redis_url=rs.url) as cluster:
        port = free_port()  # any port: the namespace has its own port space
        args = ["ip", "netns", "exec", name, sys.executable, "-m", "decode_worker", "--host", ns_ip,
                "--port", str(port), "--worker-id", f"decode-netns-{os.getpid()}"]
        worker = spawn(args, env=cluster._env)
        try:
            with grpc.insecure_channel(f"{ns_ip}:{port}") as channel:  # reached over the veth link
                health = health_pb2_grpc.HealthStub(channel)
                deadline = time.monotonic() + 120
                while True:
                    assert worker.poll() is None, f"the namespaced worker exited with {worker.returncode}"
                    try:
                        if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.RpcError:
                        pass
                    assert time.monotonic() < deadline, "the namespaced worker never became SERVING"
                    time.sleep(0.1)
            with Client(cluster.target) as c:
                results = [c.generate(f"across hosts {i}", max_tokens=12, ignore_eos=True, timeout=60) for i in range(3)]
            assert all(len(r.token_ids) == 12 for r in results)
            r = redis.Redis.from_url(rs.url, decode_responses=True)
            try:
                served = {r.hget(f"pdq:req:{res.request_id}", "decode_worker") for res in results}
            finally:
                r.close()
            assert served == {f"{ns_ip}:{port}"}  # the only decode worker: every hand-off crossed the veth
        finally:
            stop(worker, 15)
