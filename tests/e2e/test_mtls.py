"""Mutual TLS between the roles (`pdq up --mtls`): a request crosses every internal hop over mTLS
(gateway -> scheduler -> prefill -> decode, the KV hand-off on the TCP data plane), and an
internal port refuses a caller without a certificate from the cluster's CA, plaintext or TLS."""

import json
import ssl

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdq.transport import kv_tcp, kv_transfer
from pdq.client import Client
from pdq.model.loader import resolve_model
from pdq.transport.mtls import InternalTLS, dev_certificates, sync_channel
from pdq.ops.up import Cluster
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def mtls_cluster():
    # KV hand-offs over the decode worker's TCP data plane, which is mutual TLS too
    with Cluster(model="builtin", port=0, auth=False, mtls=True, metrics_port=-1,
                 extra_env={"PDQ_KV_TRANSPORT": "tcp"}) as c:
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



def _handoff(rid: str) -> list[bytes]:
    """A 4-token hand-off shaped for the built-in model."""
    cfg = json.loads((resolve_model("builtin") / "config.json").read_text())
    shape = (cfg["num_key_value_heads"], 4, cfg["hidden_size"] // cfg["num_attention_heads"])
    layers = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg["num_hidden_layers"])]
    header = pb.KVHeader(spec=pb.RequestSpec(request_id=rid, prompt_token_ids=[1] * 4,
                                             sampling=gen_pb.SamplingParams(max_tokens=2)), epoch=1, generated_token_ids=[1])
    return list(kv_transfer.encode_frames(header, layers))


async def test_the_kv_data_plane_wants_a_certificate_of_the_cluster_ca(mtls_cluster, tmp_path):
    tls = mtls_cluster._tls
    decode = f"{mtls_cluster.host}:{next(c.port for c in mtls_cluster.children if c.name == 'decode-0')}"
    with sync_channel(decode, tls) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        kv_address = stub.Reserve(pb.ReserveRequest(request_id="probe", tokens=5), timeout=5).kv_address
        stub.Release(pb.ReleaseRequest(request_id="probe"), timeout=5)
    assert kv_address

    ok = kv_tcp.Pusher(tls)  # the cluster's certificate: the worker answers (no reservation for this id)
    with pytest.raises(kv_tcp.Refused) as err:
        await ok.push(kv_address, _handoff("nobody"), timeout=10)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await ok.close()

    anonymous = kv_tcp.Pusher(tls)  # trusts the worker, shows no certificate
    anonymous._ctx = ssl.create_default_context(cadata=tls.ca.decode())
    ca, cert, key = dev_certificates(tmp_path)
    for pusher in (kv_tcp.Pusher(None), anonymous, kv_tcp.Pusher(InternalTLS(tls.ca, cert.read_bytes(), key.read_bytes()))):
        with pytest.raises(kv_tcp.Refused) as err:
            await pusher.push(kv_address, _handoff("nobody"), timeout=10)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
        await pusher.close()
