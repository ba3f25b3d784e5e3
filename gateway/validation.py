"""Pure validation of public requests: a GenerateRequest in, a RequestSpec out, or an
INVALID_ARGUMENT that names the field. Nothing reaches Redis before this passes."""

import hashlib
import math
import random
import re
from dataclasses import dataclass

import grpc

from pdq.config import TIERS
from pdq.state.request import MAX_STREAM_INTERVAL
from pdq.transport.status import StatusError
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_PROMPT_CHARS = 1 << 20
MAX_STOP = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_N = 16  # completions of one prompt (GenerateRequest.n)


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    tiers: tuple[str, ...] = TIERS  # best first; a request without one gets the first


def shown(value: str, limit: int = 40) -> str:
    """A client string as error messages may repeat it: short, so a reply never outgrows the
    header limits whatever the client sent."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


def invalid(field: str, message: str, reason: str = "INVALID_FIELD") -> StatusError:
    """INVALID_ARGUMENT whose message starts with the field, with ErrorInfo(reason, field)."""
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", reason=reason, field=field)


def resolve_sampling(s: gen_pb.SamplingParams, prompt_tokens: int, limits: Limits) -> gen_pb.SamplingParams:
    """Checks sampling fields and fills defaults (max_tokens, seed)."""
    out = gen_pb.SamplingParams()
    out.CopyFrom(s)
    room = limits.max_model_len - prompt_tokens
    if room < 1:
        raise invalid("prompt", f"is {prompt_tokens} tokens; the limit is {limits.max_model_len - 1} "
                                f"(max_model_len {limits.max_model_len} minus one generated token)", "PROMPT_TOO_LONG")
    if out.max_tokens == 0:
        out.max_tokens = min(limits.default_max_tokens, room)
    if out.max_tokens > room:
        raise invalid("sampling.max_tokens", f"{out.max_tokens} plus the {prompt_tokens}-token prompt exceeds "
                                             f"max_model_len {limits.max_model_len}; use at most {room}",
                      "MAX_TOKENS_TOO_LARGE")
    if out.min_tokens > out.max_tokens:
        raise invalid("sampling.min_tokens", f"{out.min_tokens} is more than max_tokens ({out.max_tokens})")
    if not math.isfinite(out.temperature) or not 0 <= out.temperature <= 10:
        raise invalid("sampling.temperature", f"must be in [0, 10], got {out.temperature}")
    if not math.isfinite(out.top_p) or not 0 <= out.top_p <= 1:
        raise invalid("sampling.top_p", f"must be in (0, 1] (0 = off), got {out.top_p}")
    if out.top_k > limits.vocab_size:
        raise invalid("sampling.top_k", f"must be <= the vocabulary size {limits.vocab_size}, got {out.top_k}")
    if len(out.stop) > MAX_STOP:
        raise invalid("sampling.stop", f"at most {MAX_STOP} stop strings, got {len(out.stop)}")
    for i, stop in enumerate(out.stop):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise invalid(f"sampling.stop[{i}]", f"must be 1..{MAX_STOP_CHARS} characters, got {len(stop)}")
    if len(out.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("sampling.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}, got {len(out.stop_token_ids)}")
    for i, tok in enumerate(out.stop_token_ids):
        if tok >= limits.vocab_size:
            raise invalid(f"sampling.stop_token_ids[{i}]", f"{tok} is not below the vocabulary size {limits.vocab_size}")
    for name, low, high in (("min_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                            ("repetition_penalty", 0, 10)):
        value = getattr(out, name)
        if not math.isfinite(value) or not low <= value <= high:
            raise invalid(f"sampling.{name}", f"must be in [{low}, {high}]"
                          + (" (0 = off)" if name == "repetition_penalty" else "") + f", got {value}")
    if len(out.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(out.logit_bias)}")
    for tok, bias in out.logit_bias.items():
        if tok >= limits.vocab_size:
            raise invalid("sampling.logit_bias", f"token {tok} is not below the vocabulary size {limits.vocab_size}")
        if not math.isfinite(bias) or not -100 <= bias <= 100:
            raise invalid("sampling.logit_bias", f"the bias of token {tok} must be in [-100, 100], got {bias}")
    if out.json_schema or out.regex:
        from pdq.model.grammar import check

        error = check(out.json_schema, out.regex)
        if error:
            raise invalid("sampling.json_schema" if out.json_schema else "sampling.regex", error)
    if out.HasField("logprobs") and out.logprobs > MAX_LOGPROBS:
        raise invalid("sampling.logprobs", f"at most {MAX_LOGPROBS} top tokens, got {out.logprobs}")
    if not out.HasField("seed"):
        out.seed = random.getrandbits(63)
    return out


def check_request(req: gen_pb.GenerateRequest, limits: Limits) -> None:
    """Checks the fields that need no tokenizer."""
    if bool(req.prompt) == bool(req.prompt_token_ids):
        raise invalid("prompt", "give exactly one of prompt (text) and prompt_token_ids")
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise invalid("prompt", f"is {len(req.prompt)} characters; the limit is {MAX_PROMPT_CHARS}", "PROMPT_TOO_LONG")
    if len(req.prompt_token_ids) >= limits.max_model_len:
        raise invalid("prompt_token_ids", f"has {len(req.prompt_token_ids)} tokens; the limit is {limits.max_model_len - 1}",
                      "PROMPT_TOO_LONG")
    for i, tok in enumerate(req.prompt_token_ids):
        if tok >= limits.vocab_size:
            raise invalid(f"prompt_token_ids[{i}]", f"{tok} is not below the vocabulary size {limits.vocab_size}")
    if req.request_id and not REQUEST_ID.match(req.request_id):
        raise invalid("request_id", "must be 1..128 characters of A-Z a-z 0-9 . _ : -")
    if req.tier and req.tier not in limits.tiers:
        raise invalid("tier", f"must be one of {', '.join(limits.tiers)}, got {shown(req.tier)}")
    if req.timeout_ms > MAX_TIMEOUT_MS:
        raise invalid("timeout_ms", f"must be at most {MAX_TIMEOUT_MS} (24 h), got {req.timeout_ms}")
    if req.n > MAX_N:
        raise invalid("n", f"must be 0..{MAX_N} (completions of the prompt), got {req.n}")
    if req.stream_interval > MAX_STREAM_INTERVAL:
        raise invalid("stream_interval", f"must be 0..{MAX_STREAM_INTERVAL} (decode steps per write), "
                                         f"got {req.stream_interval}")


def content_hash(req: gen_pb.GenerateRequest) -> str:
    """A digest of what the client asked for: its prompt (text or token ids), its sampling
    fields as sent (before the gateway fills defaults: a seed it picks, max_tokens) and its
    tier. Deadlines, timeouts, the stream interval and the request id are how it is asked, not
    what: they do not enter it. Two requests with one client request_id and different digests
    are different requests (the scheduler refuses the second with ALREADY_EXISTS)."""
    asked = gen_pb.GenerateRequest(prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, tier=req.tier)
    asked.sampling.CopyFrom(req.sampling)
    asked.sampling.DiscardUnknownFields()
    if not asked.sampling.ListFields():  # sampling {} asks for what no sampling does
        asked.ClearField("sampling")
    return hashlib.sha256(asked.SerializeToString(deterministic=True)).hexdigest()


def build_spec(req: gen_pb.GenerateRequest, prompt_ids: list[int], tenant: str, request_id: str,
               now_ms: int, deadline_ms: int, limits: Limits, default_interval: int = 1) -> pb.RequestSpec:
    """default_interval: the stream interval when the request has none (0)."""
    if not prompt_ids:
        raise invalid("prompt", "is empty after tokenization")
    sampling = resolve_sampling(req.sampling, len(prompt_ids), limits)
    return pb.RequestSpec(request_id=request_id, tenant=tenant, tier=req.tier or limits.tiers[0],
                          prompt_token_ids=prompt_ids, sampling=sampling, arrival_ms=now_ms,
                          deadline_ms=deadline_ms, stream_interval=req.stream_interval or default_interval,
                          content_hash=content_hash(req), client_request_id=req.request_id)
