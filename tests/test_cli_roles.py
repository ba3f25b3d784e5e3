"""`pdq gateway|scheduler|prefill|decode [flags]`: each role takes its own flags (the README's
"A cluster by hand" and the Kubernetes manifests start the roles this way)."""

import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.ops.redis_server import free_port

PDQ = [sys.executable, "-m", "pdq.cli"]


@pytest.mark.parametrize("role, flag", [("gateway", "--scheduler-address"), ("scheduler", "--dispatch-interval-ms"),
                                        ("prefill", "--max-batched-tokens"), ("decode", "--kv-transport")])
def test_each_role_lists_its_own_flags(role, flag):
    out = subprocess.run(PDQ + [role, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert flag in out.stdout and "--port" in out.stdout


def test_a_role_started_by_hand_serves_and_stops_on_sigterm(redis_server):
    port = free_port()
    proc = subprocess.Popen(PDQ + ["scheduler", "--port", str(port), "--redis-url", redis_server.url,
                                   "--metrics-port", "-1", "--key-prefix", "handstart"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_unreachable_redis_is_one_clear_line_without_the_password():
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    # a start rides a Redis outage of up to --redis-outage-s too, then gives up
    out = subprocess.run(PDQ + ["scheduler", "--port", "0", "--redis-url", url, "--metrics-port", "-1",
                                "--redis-outage-s", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "scheduler cannot reach Redis at redis://:***@127.0.0.1" in out.stderr
    assert "hunter2" not in out.stderr and "Traceback" not in out.stderr


def test_pdq_up_refuses_a_malformed_redis_url_at_once_without_showing_its_password():
    for url, says in (("http://:hunter2@redis:6379/0", "must start with redis://"),
                      ("redis+sentinel://:hunter2@s1:26379", "service")):
        out = subprocess.run(PDQ + ["up", "--redis-url", url], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and says in out.stderr and out.stderr.startswith("pdq up: --redis-url: ")
        assert "hunter2" not in out.stderr and "Traceback" not in out.stderr


def test_an_http_port_in_use_is_one_clear_line(redis_server):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        out = subprocess.run(PDQ + ["gateway", "--port", str(free_port()), "--redis-url", redis_server.url,
                                    "--metrics-port", "-1", "--http-port", str(busy), "--model", "builtin:tiny"],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"gateway cannot start: the HTTP API cannot listen on 127.0.0.1:{busy}" in out.stderr
    assert "--http-port" in out.stderr and "Traceback" not in out.stderr
