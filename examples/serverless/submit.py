"""Serverless handler (AWS Lambda style): submit a generation and return its id at once.

    event: {"prompt": "...", "max_tokens": 64, "temperature": 0.8, "request_id": "job-42", ...}
    ->     {"request_id": "9f2c..."}
           {"error": "INVALID_ARGUMENT", "message": "event.max_tokens: expected an integer, got 'ten'"}
           {"error": "INVALID_ARGUMENT", "message": "sampling.max_tokens: ..."} when pdq refuses it
           {"error": "UNAVAILABLE", "message": "..."} and other gRPC statuses, by their name

It never raises on a bad event or a failed call: the answer is then {"error", "message"}, the
error a gRPC status name. Pass a `request_id` of your own (an idempotency key) so that a retried
invocation returns the same request instead of starting a second generation. The function never
waits for tokens: fetch the result later with fetch.handler. Reads PDQ_TARGET (default
127.0.0.1:50051), PDQ_API_KEY and PDQ_TLS_CA.
"""

import os
from functools import lru_cache

import grpc

from pdq.client import Client

CALL_TIMEOUT_S = 10.0

# Event fields passed on to Client.submit (see pdq.v1.GenerateRequest / SamplingParams), and
# the JSON type each takes.
FIELDS = {"max_tokens": "integer", "temperature": "number", "top_k": "integer", "top_p": "number",
          "seed": "integer", "stop": "list of strings", "ignore_eos": "boolean", "request_id": "string",
          "tier": "string", "timeout_ms": "integer"}


@lru_cache(maxsize=4)
def client(target: str, api_key: str | None) -> Client:
    """One channel per (target, key), reused by warm invocations."""
    return Client(target, api_key=api_key)


def is_a(value: object, kind: str) -> bool:
    """Whether a JSON value is of `kind` (booleans are not numbers here)."""
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "non-empty list of integers":
        return isinstance(value, list) and bool(value) and all(is_a(v, "integer") for v in value)
    raise ValueError(kind)


def invalid(message: str) -> dict:
    return {"error": "INVALID_ARGUMENT", "message": message}


def problem(event: object) -> str:
    """What is wrong with the event ("" if nothing)."""
    if not isinstance(event, dict):
        return f"event: expected a JSON object, got {type(event).__name__}"
    prompt, ids = event.get("prompt"), event.get("prompt_token_ids")
    if prompt is None and ids is None:
        return "event: give a prompt (or prompt_token_ids)"
    if prompt is not None and ids is not None:
        return "event: give a prompt or prompt_token_ids, not both"
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        return f"event.prompt: expected a non-empty string, got {prompt!r:.80}"
    if ids is not None and not is_a(ids, "non-empty list of integers"):
        return f"event.prompt_token_ids: expected a non-empty list of integers, got {ids!r:.80}"
    for name, kind in FIELDS.items():
        if name in event and not is_a(event[name], kind):
            article = "an" if kind[0] in "aeiou" else "a"
            return f"event.{name}: expected {article} {kind}, got {event[name]!r:.80}"
    return ""


def handler(event: dict, context: object = None) -> dict:
    if wrong := problem(event):
        return invalid(wrong)
    prompt = event.get("prompt") or event["prompt_token_ids"]
    kw = {k: event[k] for k in FIELDS if k in event}
    try:
        Client.request(prompt, **kw)  # what JSON allows and protobuf does not: e.g. a seed of -1 or 2**64
    except (TypeError, ValueError) as exc:
        return invalid(f"event: {exc}")
    c = client(os.environ.get("PDQ_TARGET", "127.0.0.1:50051"), os.environ.get("PDQ_API_KEY"))
    try:
        request_id = c.submit(prompt, timeout=CALL_TIMEOUT_S, **kw)
    except grpc.RpcError as exc:
        return {"error": exc.code().name, "message": exc.details()}
    return {"request_id": request_id}
