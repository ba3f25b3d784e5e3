"""Protobuf <-> internal types, at the edges only."""

from pdq.engine.sampling import SamplingParams
from pdq.v1 import generation_pb2 as gen_pb


def sampling_from_pb(p: gen_pb.SamplingParams) -> SamplingParams:
    """From a resolved SamplingParams message (the scheduler/gateway filled max_tokens and seed)."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                          top_p=p.top_p if p.top_p > 0 else 1.0,
                          seed=p.seed if p.HasField("seed") else None,
                          stop=tuple(p.stop), ignore_eos=p.ignore_eos, stop_token_ids=frozenset(p.stop_token_ids),
                          min_p=p.min_p, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty or 1.0, logit_bias=dict(p.logit_bias),
                          logprobs=p.logprobs if p.HasField("logprobs") else None,
                          json_schema=p.json_schema, regex=p.regex, min_tokens=p.min_tokens)
