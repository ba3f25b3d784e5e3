"""Mutual TLS between the roles (`pdq up --mtls`): a request crosses every internal hop over mTLS
(gateway -> scheduler -> prefill -> decode), and an internal port refuses a caller without a
certificate from the cluster's CA, plaintext or TLS."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.client import Client
from pdq.mtls import InternalTLS, dev_certificates, sync_channel
from pdq.up import Cluster


@pytest.fixture(scope="module")
def mtls_cluster():
    with Cluster(model="builtin", port=0, auth=False, mtls=True, metrics_port=-1) as c:
        yield c


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_request_crosses_every_internal_hop_over_mtls(mtls_cluster):
    with Client(mtls_cluster.target) as c:  # the gateway's public port: plaintext here (no --tls-cert)
        result = c.generate("over mutual tls", max_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4


@pytest.mark.parametrize("role", ["scheduler", "prefill-0", "decode-0"])
def test_internal_ports_want_a_certificate_of_the_cluster_ca(mtls_cluster, role, tmp_path):
    address = f"{mtls_cluster.host}:{next(c.port for c in mtls_cluster.children if c.name == role)}"
    with sync_channel(address, mtls_cluster._tls) as ok:  # the cluster's own certificate
        assert _health(ok) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(address) as plain:
        with pytest.raises(grpc.RpcError) as err:
            _health(plain)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    tls = mtls_cluster._tls
    no_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca)  # trusts the server, shows no certificate
    with grpc.secure_channel(address, no_cert, options=tls.options()) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            _health(anonymous)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    ca, cert, key = dev_certificates(tmp_path)  # a certificate of another CA
    stranger = InternalTLS(tls.ca, cert.read_bytes(), key.read_bytes())
    with sync_channel(address, stranger) as other:
        with pytest.raises(grpc.RpcError) as err:
            _health(other)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

