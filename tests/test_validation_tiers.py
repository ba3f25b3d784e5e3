"""The gateway checks tiers against the cluster's configured tiers (PDQ_TIERS), not a fixed list."""

import grpc
import pytest

from gateway.validation import Limits, build_spec, check_request
from pdq.config import GatewayConfig
from pdq.transport.status import StatusError
from pdq.v1 import generation_pb2 as gen_pb

LIMITS = Limits(max_model_len=64, vocab_size=100, default_max_tokens=4,
                tiers=tuple(GatewayConfig(tiers="gold, bronze").tier_names))


def test_a_configured_tier_is_accepted_and_the_first_is_the_default():
    check_request(gen_pb.GenerateRequest(prompt="hi", tier="bronze"), LIMITS)
    spec = build_spec(gen_pb.GenerateRequest(prompt="hi"), [1, 2], "acme", "r1", 0, 0, LIMITS)
    assert spec.tier == "gold"


def test_a_tier_the_cluster_does_not_have_is_invalid_and_named():
    with pytest.raises(StatusError) as err:
        check_request(gen_pb.GenerateRequest(prompt="hi", tier="interactive"), LIMITS)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.field == "tier"
    assert err.value.message == "tier: must be one of gold, bronze, got 'interactive'"
