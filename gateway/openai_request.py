"""OpenAI-compatible request bodies -> pdq's `GenerateRequest`: the fields both endpoints share
and those of `/v1/completions`, as vLLM's server reads them, checked one by one (a wrong field is a
400 naming it). Chat's own (messages, templates, tools) are in `gateway.chat_request`.

Pure: no IO. A field pdq does not serve (`suffix`, as vLLM) is refused when set to anything but
its neutral value, never silently ignored; fields that change nothing here (`user`) are.
"""

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from gateway.validation import MAX_N
from pdq.model.grammar import check
from pdq.v1 import generation_pb2 as gen_pb

MAX_LOGPROBS = 20  # top tokens per position (vLLM's default --max-logprobs is 20)
U32 = 2**32 - 1  # the proto's uint32 fields: the largest number they hold
# fields refused unless neutral: name -> its neutral values (what the feature does when off)
NOT_YET = {"suffix": (None, "")}


class ApiError(Exception):
    """A request the door refuses: HTTP status, a message a person can act on, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code


@dataclass(frozen=True)
class Parsed:
    """A body as pdq runs it."""

    request: gen_pb.GenerateRequest
    stream: bool
    include_usage: bool
    echo: bool = False  # completions: the prompt comes back before each choice's text


def _bad(field: str, want: str, got: Any) -> ApiError:
    return ApiError(400, f"{field}: must be {want}, got {got!r}"[:300], param=field)


def _number(body: dict, field: str, default: float, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _bad(field, f"a number in [{low}, {high}]", value)
    return float(value)


def _int(body: dict, field: str, default: int | None, low: int, high: int = U32) -> int | None:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, f"an integer in [{low}, {high}]", value)
    return value


def _bool(body: dict, field: str, default: bool = False) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(field, "true or false", value)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return stop
    raise _bad("stop", "a non-empty string or a list of them", stop)


def is_token_id(t: Any) -> bool:
    """A JSON value that is a token id the proto can carry (the gateway checks the vocabulary)."""
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= U32


def _token_ids(body: dict, field: str) -> list[int]:
    value = body.get(field)
    if value is None:
        return []
    if isinstance(value, list) and all(is_token_id(t) for t in value):
        return value
    raise _bad(field, "a list of token ids", value)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]} (JSON keys are strings)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", "an object of token id -> bias", value)
    out = {}
    for key, bias in value.items():
        if not str(key).isdigit() or int(key) > U32 or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise _bad("logit_bias", "token ids mapped to numbers in [-100, 100]", {key: bias})
        out[int(key)] = float(bias)
    return out


def _structured(body: dict) -> tuple[str, str]:
    """Structured output -> (JSON Schema as JSON text, regex): OpenAI's `response_format`
    (json_object, json_schema) or vLLM's `guided_json` / `guided_regex`. Compiled by the gateway's
    checks (a schema that does not compile is a 400 naming the field)."""
    fmt, schema, regex = body.get("response_format"), body.get("guided_json"), body.get("guided_regex")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise _bad("response_format", "{type: json_schema, json_schema: {name, schema: {...}}}", fmt)
        elif kind != "text":
            raise _bad("response_format", "{type: text | json_object | json_schema}", fmt)
    if schema is not None and not isinstance(schema, (dict, str)):
        raise _bad("guided_json", "a JSON Schema (object or JSON text)", schema)
    if regex is not None and (not isinstance(regex, str) or not regex):
        raise _bad("guided_regex", "a non-empty regular expression", regex)
    if schema is not None and regex:
        raise ApiError(400, "guided_regex: give a JSON schema (response_format, guided_json) or a regex, not both",
                       param="guided_regex")
    text = schema if isinstance(schema, str) else json.dumps(schema) if schema is not None else ""
    error = check(text, regex or "") if text or regex else ""
    if error:
        field = "response_format" if fmt is not None else "guided_json" if text else "guided_regex"
        raise ApiError(400, f"{field}: {error}", param=field)
    return text, regex or ""


def _tier(body: dict, tiers: tuple[str, ...]) -> str:
    """pdq's `tier` by name, or vLLM's `priority` (0 = the first tier; lower runs sooner)."""
    tier = body.get("tier")
    if tier is not None:
        if not isinstance(tier, str) or tier not in tiers:
            raise _bad("tier", f"one of {list(tiers)}", tier)
        return tier
    priority = _int(body, "priority", None, 0)
    return "" if priority is None else tiers[min(priority, len(tiers) - 1)]


def _common(body: dict, served: str, tiers: tuple[str, ...], default_max_tokens: int | None) -> Parsed:
    """The fields both endpoints share; the prompt is the caller's to set."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"the served model's name ({served!r})", model)
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist: this server serves {served!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    for field, neutral in NOT_YET.items():
        if field in body and body[field] not in neutral:
            raise ApiError(400, f"{field}: not supported by this server yet (leave it out)", param=field)
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    max_tokens = _int(body, "max_tokens", max_tokens if max_tokens is not None else default_max_tokens, 1)
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    sampling = gen_pb.SamplingParams(max_tokens=max_tokens or 0,
                                     temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                                     top_p=_number(body, "top_p", 1.0, 0.0, 1.0), top_k=max(0, top_k),
                                     stop=_stop(body), ignore_eos=_bool(body, "ignore_eos"),
                                     stop_token_ids=_token_ids(body, "stop_token_ids"),
                                     min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
                                     presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                                     frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                                     repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 10.0),
                                     logit_bias=_logit_bias(body), min_tokens=_int(body, "min_tokens", 0, 0))
    if seed is not None:
        sampling.seed = seed % 2**64
    request_id = body.get("request_id", "")
    if not isinstance(request_id, str):
        raise _bad("request_id", "a string", request_id)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    stream = _bool(body, "stream")
    include_usage = bool(options and _bool(options, "include_usage"))
    if options and not stream:
        raise ApiError(400, "stream_options: only with stream: true", param="stream_options")
    sampling.json_schema, sampling.regex = _structured(body)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise ApiError(400, f"best_of: only equal to n ({n}) here: every completion is returned", param="best_of")
    timeout_ms = _int(body, "timeout_ms", 0, 0, 86_400_000)  # pdq's: the request's deadline, from its arrival
    return Parsed(gen_pb.GenerateRequest(sampling=sampling, request_id=request_id, tier=_tier(body, tiers),
                                         timeout_ms=timeout_ms, n=n), stream, include_usage)


def completion(body: dict, served: str, tiers: tuple[str, ...]) -> Parsed:
    """A `/v1/completions` body. `prompt`: a string or token ids (or a list of one of either);
    `max_tokens` defaults to 16, as OpenAI's."""
    parsed = _common(body, served, tiers, 16)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if logprobs is not None:
        parsed.request.sampling.logprobs = logprobs
    if _bool(body, "echo"):
        if logprobs is not None:
            raise ApiError(400, "echo: not with logprobs (this server does not compute the prompt's logprobs); "
                                "leave one of them out", param="echo")
        parsed = dataclasses.replace(parsed, echo=True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        parsed.request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
        parsed.request.prompt_token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, f"prompt: one prompt per request (got a batch of {len(prompt)}): send each on its own "
                            "request; they are batched on the server", param="prompt")
    else:
        raise _bad("prompt", "a non-empty string or list of token ids", prompt)
    return parsed
