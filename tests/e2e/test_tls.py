"""The gateway serves TLS with --tls-cert/--tls-key; a client trusting the CA gets through."""

import os
import subprocess
import sys

import grpc
import pytest

from pdq.client import Client
from pdq.ops.redis_server import free_port
from tests.e2e.conftest import KEYS


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_tls_gateway(cluster, auth_file, cert):
    port = free_port()
    sched = next(c for c in cluster.children if c.name == "scheduler")
    env = {"PDQ_REDIS_URL": cluster.redis_url, "PDQ_AUTH_FILE": str(auth_file), "PDQ_MODEL": "builtin"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(port), "--tls-cert", str(cert[0]),
                             "--tls-key", str(cert[1]), "--scheduler-address", f"127.0.0.1:{sched.port}"],
                            env={**os.environ, **env})
    try:
        with Client(f"127.0.0.1:{port}", api_key=KEYS["acme"], tls_ca=str(cert[0])) as c:
            grpc.channel_ready_future(c.channel).result(timeout=60)
            assert len(c.generate("over tls", max_tokens=3, ignore_eos=True).token_ids) == 3
        with Client(f"127.0.0.1:{port}", api_key=KEYS["acme"]) as plain:  # plaintext client: refused
            with pytest.raises(grpc.RpcError) as err:
                plain.generate("no tls", max_tokens=1, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(10)
