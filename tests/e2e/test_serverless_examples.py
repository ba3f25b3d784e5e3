"""The serverless handlers (examples/serverless) against a real cluster: submit returns the id
at once, fetch returns the state and, once done, the result."""

import importlib.util
import time
import uuid
from functools import lru_cache
from pathlib import Path

import pytest

from pdq.ops.redis_server import free_port
from tests.e2e.conftest import KEYS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "serverless"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"pdq_serverless_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def handlers(cluster, monkeypatch):
    monkeypatch.setenv("PDQ_TARGET", cluster.target)
    monkeypatch.setenv("PDQ_API_KEY", KEYS["acme"])
    monkeypatch.delenv("PDQ_TLS_CA", raising=False)
    submit, fetch = load("submit"), load("fetch")
    made = []  # every client the handlers cached, closed at the end
    for module in (submit, fetch):
        def tracked(target, api_key, make=module.client.__wrapped__):
            made.append(make(target, api_key))
            return made[-1]
        module.client = lru_cache(maxsize=4)(tracked)
    yield submit.handler, fetch.handler
    for c in made:
        c.close()


def fetch_until_done(fetch, request_id: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = fetch({"request_id": request_id, "wait_ms": 1_000}, None)
        assert "state" in out, out  # not an error from pdq
        if out["done"]:
            return out
    raise AssertionError(f"{request_id} not done after {timeout_s}s")


def test_submit_returns_an_id_at_once_and_fetch_returns_the_result(handlers, client):
    submit, fetch = handlers
    started = time.monotonic()
    out = submit({"prompt": "serverless hello", "max_tokens": 48, "ignore_eos": True}, None)
    assert set(out) == {"request_id"}, out
    rid = out["request_id"]

    now = fetch({"request_id": rid, "wait_ms": 0}, None)
    assert now["request_id"] == rid and now["state"] in (
        "QUEUED", "PREFILLING", "TRANSFERRING", "DECODING", "COMPLETED")
    assert time.monotonic() - started < 5.0  # neither handler waited for the generation

    done = fetch_until_done(fetch, rid)
    assert done["state"] == "COMPLETED" and done["finish_reason"] == "length" and done["error"] == ""
    assert done["usage"]["completion_tokens"] == 48 == len(done["token_ids"])
    direct = client.generate("serverless hello", max_tokens=48, ignore_eos=True)
    assert (done["text"], done["token_ids"]) == (direct.text, direct.token_ids)  # greedy: the same tokens


def test_a_retried_submit_with_the_same_request_id_is_one_request(handlers):
    submit, fetch = handlers
    key = f"lambda-{uuid.uuid4().hex[:12]}"
    event = {"prompt": "only once", "max_tokens": 4, "request_id": key}
    first, retry = submit(event, None), submit(event, None)
    assert first["request_id"] == retry["request_id"]
    assert fetch_until_done(fetch, key)["request_id"] == first["request_id"]  # fetchable by the client key


def test_errors_come_back_as_the_grpc_status(handlers):
    submit, fetch = handlers
    bad = submit({"prompt": "x", "max_tokens": 100_000}, None)
    assert bad["error"] == "INVALID_ARGUMENT" and bad["message"].startswith("sampling.max_tokens")
    assert submit({}, None)["error"] == "INVALID_ARGUMENT"
    assert fetch({"request_id": "no-such-request"}, None)["error"] == "NOT_FOUND"
    assert fetch({}, None)["error"] == "INVALID_ARGUMENT"


def test_fetch_follows_a_cancelled_request(handlers, client):
    submit, fetch = handlers
    rid = submit({"prompt": "cancel me", "max_tokens": 1000, "ignore_eos": True}, None)["request_id"]
    client.cancel(rid)
    done = fetch_until_done(fetch, rid)
    assert done["state"] == "CANCELLED" and done["finish_reason"] == "cancelled"


@pytest.mark.parametrize("event, names", [
    (None, "JSON object"),
    (["prompt"], "JSON object"),
    ({"max_tokens": 4}, "give a prompt"),
    ({"prompt": 42}, "event.prompt"),
    ({"prompt": ""}, "event.prompt"),
    ({"prompt": "x", "prompt_token_ids": [1, 2]}, "not both"),
    ({"prompt_token_ids": [1, "two"]}, "event.prompt_token_ids"),
    ({"prompt_token_ids": "1 2 3"}, "event.prompt_token_ids"),
    ({"prompt": "x", "max_tokens": "ten"}, "event.max_tokens: expected an integer, got 'ten'"),
    ({"prompt": "x", "max_tokens": 4.5}, "event.max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "event.temperature: expected a number"),
    ({"prompt": "x", "top_p": True}, "event.top_p"),
    ({"prompt": "x", "ignore_eos": "yes"}, "event.ignore_eos: expected a boolean"),
    ({"prompt": "x", "stop": "\n"}, "event.stop: expected a list of strings"),
    ({"prompt": "x", "stop": [1]}, "event.stop"),
    ({"prompt": "x", "request_id": 42}, "event.request_id: expected a string"),
    ({"prompt": "x", "tier": ["batch"]}, "event.tier"),
    ({"prompt": "x", "seed": -1}, "event: "),
    ({"prompt": "x", "seed": 2 ** 64}, "event: "),
    ({"prompt": "x", "timeout_ms": 2 ** 70}, "event: "),
])
def test_submit_answers_a_bad_event_with_an_error_naming_what_is_wrong(handlers, event, names):
    submit, _ = handlers
    out = submit(event, None)
    assert set(out) == {"error", "message"} and out["error"] == "INVALID_ARGUMENT", out
    assert names in out["message"], out


@pytest.mark.parametrize("event, names", [
    (None, "JSON object"),
    ("req-1", "JSON object"),
    ({}, "request_id is required"),
    ({"request_id": 42}, "event.request_id: expected a string, got 42"),
    ({"request_id": "r", "wait_ms": "soon"}, "event.wait_ms: expected an integer, got 'soon'"),
    ({"request_id": "r", "wait_ms": 1.5}, "event.wait_ms"),
    ({"request_id": "r", "wait_ms": False}, "event.wait_ms"),
])
def test_fetch_answers_a_bad_event_with_an_error_naming_what_is_wrong(handlers, event, names):
    _, fetch = handlers
    out = fetch(event, None)
    assert set(out) == {"error", "message"} and out["error"] == "INVALID_ARGUMENT", out
    assert names in out["message"], out


def test_an_unknown_request_id_is_not_found_by_name(handlers):
    _, fetch = handlers
    out = fetch({"request_id": "no-such-request-7", "wait_ms": 0}, None)
    assert out["error"] == "NOT_FOUND" and "no-such-request-7" in out["message"], out


def test_grpc_failures_come_back_as_their_status_name(handlers, cluster, monkeypatch):
    submit, fetch = handlers
    monkeypatch.setenv("PDQ_API_KEY", "not-a-real-key-123")
    assert submit({"prompt": "x"}, None)["error"] == "UNAUTHENTICATED"
    assert fetch({"request_id": "r"}, None)["error"] == "UNAUTHENTICATED"
    monkeypatch.setenv("PDQ_TARGET", f"127.0.0.1:{free_port()}")  # nothing listens there
    assert submit({"prompt": "x"}, None)["error"] == "UNAVAILABLE"
    assert fetch({"request_id": "r", "wait_ms": 0}, None)["error"] == "UNAVAILABLE"
