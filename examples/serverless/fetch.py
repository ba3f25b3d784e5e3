"""Serverless handler (AWS Lambda style): fetch the state, and the result once done, of a
request made with submit.handler.

    event: {"request_id": "9f2c...", "wait_ms": 1000}
    ->     {"request_id": "9f2c...", "state": "DECODING", "done": false, "text": "so far", ...}
           {"request_id": "9f2c...", "state": "COMPLETED", "done": true, "text": "...",
            "token_ids": [...], "finish_reason": "length",
            "usage": {"prompt_tokens": 5, "completion_tokens": 64}, "error": ""}
           {"error": "NOT_FOUND", "message": "no request '...'"} for an unknown or expired id
           {"error": "INVALID_ARGUMENT", "message": "event.wait_ms: expected an integer, got 'soon'"}

It never raises on a bad event or a failed call: the answer is then {"error", "message"}, the
error a gRPC status name. wait_ms (default 1000, at most 10000) long-polls for the end, so a
poller needs few invocations without paying for a long-running function. Reads PDQ_TARGET
(default 127.0.0.1:50051), PDQ_API_KEY and PDQ_TLS_CA.
"""

import os
from functools import lru_cache

import grpc

from pdq.client import Client, finish_name

DEFAULT_WAIT_MS = 1_000
MAX_WAIT_MS = 10_000
CALL_TIMEOUT_S = 10.0  # on top of the wait


@lru_cache(maxsize=4)
def client(target: str, api_key: str | None) -> Client:
    """One channel per (target, key), reused by warm invocations."""
    return Client(target, api_key=api_key)


def invalid(message: str) -> dict:
    return {"error": "INVALID_ARGUMENT", "message": message}


def handler(event: dict, context: object = None) -> dict:
    if not isinstance(event, dict):
        return invalid(f"event: expected a JSON object, got {type(event).__name__}")
    request_id = event.get("request_id")
    if not request_id:
        return invalid("event: request_id is required")
    if not isinstance(request_id, str):
        return invalid(f"event.request_id: expected a string, got {request_id!r:.80}")
    wait_ms = event.get("wait_ms", DEFAULT_WAIT_MS)
    if not isinstance(wait_ms, int) or isinstance(wait_ms, bool):
        return invalid(f"event.wait_ms: expected an integer, got {wait_ms!r:.80}")
    wait_ms = max(0, min(wait_ms, MAX_WAIT_MS))
    c = client(os.environ.get("PDQ_TARGET", "127.0.0.1:50051"), os.environ.get("PDQ_API_KEY"))
    try:
        r = c.get_result(request_id, wait_ms=wait_ms, timeout=wait_ms / 1000 + CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return {"error": exc.code().name, "message": exc.details()}
    out = {"request_id": r.request_id, "state": r.state, "done": r.done, "text": r.result.text,
           "token_ids": list(r.result.token_ids)}
    if r.done:
        out.update(finish_reason=finish_name(r.result.finish_reason), error=r.error,
                   usage={"prompt_tokens": r.result.usage.prompt_tokens,
                          "completion_tokens": r.result.usage.completion_tokens})
    return out
