"""Serverless handler (AWS Lambda style): submit a generation and return its id at once.

    event: {"prompt": "...", "max_tokens": 64, "temperature": 0.8, "request_id": "job-42", ...}
    ->     {"request_id": "9f2c..."}
           {"error": "INVALID_ARGUMENT", "message": "sampling.max_tokens: ..."} when pdq refuses it

Pass a `request_id` of your own (an idempotency key) so that a retried invocation returns the
same request instead of starting a second generation. The function never waits for tokens:
fetch the result later with fetch.handler. Reads PDQ_TARGET (default 127.0.0.1:50051),
PDQ_API_KEY and PDQ_TLS_CA.
"""

import os
from functools import lru_cache

import grpc

from pdq.client import Client

# Event fields passed on to Client.submit (see pdq.v1.GenerateRequest / SamplingParams).
FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "request_id", "tier",
          "timeout_ms")


@lru_cache(maxsize=4)
def client(target: str, api_key: str | None) -> Client:
    """One channel per (target, key), reused by warm invocations."""
    return Client(target, api_key=api_key)


def handler(event: dict, context: object = None) -> dict:
    prompt = event.get("prompt") or event.get("prompt_token_ids")
    if not prompt:
        return {"error": "INVALID_ARGUMENT", "message": "event: give a prompt (or prompt_token_ids)"}
    c = client(os.environ.get("PDQ_TARGET", "127.0.0.1:50051"), os.environ.get("PDQ_API_KEY"))
    try:
        request_id = c.submit(prompt, **{k: event[k] for k in FIELDS if k in event})
    except grpc.RpcError as exc:
        return {"error": exc.code().name, "message": exc.details()}
    return {"request_id": request_id}
