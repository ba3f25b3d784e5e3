"""The content digest of a request (gateway.validation.content_hash): what the client asked for,
as sent. A retry with the same client request_id is the same request only if its digest is."""

from gateway.validation import Limits, build_spec, content_hash
from pdq.v1 import generation_pb2 as gen_pb

LIMITS = Limits(max_model_len=64, vocab_size=100, default_max_tokens=4)


def request(**fields) -> gen_pb.GenerateRequest:
    sampling = fields.pop("sampling", None)
    req = gen_pb.GenerateRequest(prompt="hello", request_id="job-1", **fields)
    if sampling is not None:
        req.sampling.CopyFrom(gen_pb.SamplingParams(**sampling))
    return req


def spec(req: gen_pb.GenerateRequest, **kwargs):
    args = dict(prompt_ids=[1, 2, 3], tenant="acme", request_id="internal", now_ms=0, deadline_ms=0, limits=LIMITS)
    args.update(kwargs)
    return build_spec(req, **args)


def test_the_spec_carries_the_digest_and_the_clients_request_id():
    req = request(sampling={"temperature": 0.5})
    built = spec(req)
    assert built.content_hash == content_hash(req) and len(built.content_hash) == 64
    assert built.client_request_id == "job-1"
    assert spec(gen_pb.GenerateRequest(prompt="hello")).client_request_id == ""


def test_what_the_gateway_fills_in_does_not_enter_the_digest():
    req = request(sampling={"temperature": 0.8})  # no seed, no max_tokens: the gateway picks them
    first, second = spec(req), spec(req)
    assert first.sampling.seed != second.sampling.seed  # a seed of its own each time
    assert first.sampling.max_tokens == LIMITS.default_max_tokens
    assert first.content_hash == second.content_hash == content_hash(req)


def test_how_a_request_is_asked_does_not_enter_the_digest():
    base = content_hash(request(sampling={"max_tokens": 3}))
    assert content_hash(request(sampling={"max_tokens": 3}, timeout_ms=500, stream_interval=4)) == base
    other_id = request(sampling={"max_tokens": 3})
    other_id.request_id = "job-2"
    assert content_hash(other_id) == base
    assert spec(request(sampling={"max_tokens": 3}), deadline_ms=123, now_ms=7).content_hash == base
    assert content_hash(request(sampling={})) == content_hash(request())  # sampling {} = no sampling


def test_a_different_prompt_sampling_or_tier_is_a_different_digest():
    base = content_hash(request(sampling={"temperature": 0.5}))
    changed = [
        request(sampling={"temperature": 0.5}, tier="batch"),
        request(sampling={"temperature": 0.6}),
        request(sampling={"temperature": 0.5, "seed": 0}),  # a seed asked for, even 0, is not "any seed"
        request(sampling={"temperature": 0.5, "stop": ["x"]}),
        request(sampling={"temperature": 0.5, "max_tokens": 4}),  # the default's value, but asked for
    ]
    other_prompt = request(sampling={"temperature": 0.5})
    other_prompt.prompt = "hello!"
    token_ids = gen_pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=gen_pb.SamplingParams(temperature=0.5))
    digests = {content_hash(r) for r in [*changed, other_prompt, token_ids]}
    assert base not in digests and len(digests) == len(changed) + 2
