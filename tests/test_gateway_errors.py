"""How the gateway turns a failed call to the scheduler, or its own failure to follow a request,
into the client's status (pure mapping; gateway.errors)."""

import grpc
import pytest
import redis

from gateway.follower import FollowerUnavailable
from gateway.errors import resumable, scheduler_error
from pdq.transport.status import StatusError


def failed(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def details_of(error: StatusError) -> bytes:
    return dict(error.trailing_metadata()).get("grpc-status-details-bin", b"")


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND])
def test_the_schedulers_answers_reach_the_client_as_they_are(code):
    scheduler_says = StatusError(code, "what the scheduler said", reason="SOME_REASON", retry_ms=250)
    error = scheduler_error(failed(code, scheduler_says.message, scheduler_says.trailing_metadata()), "retry")
    assert error.code == code and error.message == "what the scheduler said"
    assert details_of(error) == details_of(scheduler_says)  # ErrorInfo and RetryInfo, for programs
    assert dict(error.trailing_metadata())["grpc-retry-pushback-ms"] == "250"


def test_an_unavailable_scheduler_with_its_own_retry_hint_is_forwarded():
    scheduler_says = StatusError(grpc.StatusCode.UNAVAILABLE, "Redis unreachable (x); retry",
                                 reason="REDIS_UNAVAILABLE", retry_ms=1000)
    error = scheduler_error(failed(grpc.StatusCode.UNAVAILABLE, scheduler_says.message,
                                   scheduler_says.trailing_metadata()), "retry")
    assert error.code == grpc.StatusCode.UNAVAILABLE and details_of(error) == details_of(scheduler_says)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL])
def test_a_scheduler_out_of_reach_is_unavailable_with_a_retry_hint(code):
    error = scheduler_error(failed(code, "connection refused"), "retry with the same request_id")
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.retry_ms > 0
    assert error.message.startswith(f"scheduler unreachable ({code.name}: connection refused)")
    assert error.message.endswith("retry with the same request_id")


def test_the_gateways_own_failures_to_follow_are_unavailable_with_where_to_resume():
    how = "resume with StreamResult(request_id='r', offset=3)"
    for exc, reason in [(FollowerUnavailable("Redis unreachable for 30 s (x)", "REDIS_UNAVAILABLE"), "REDIS_UNAVAILABLE"),
                        (FollowerUnavailable("the gateway is stopping", "GATEWAY_STOPPING"), "GATEWAY_STOPPING"),
                        (redis.ConnectionError("Error 111"), "REDIS_UNAVAILABLE")]:
        error = resumable(exc, how)
        assert error.code == grpc.StatusCode.UNAVAILABLE and error.reason == reason and error.retry_ms > 0
        assert error.message.endswith(how)
    assert resumable(ValueError("a bug"), how) is None  # not the gateway's to explain: the guard logs it
    assert resumable(StatusError(grpc.StatusCode.CANCELLED, "cancelled"), how) is None


@pytest.mark.parametrize("code, status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    (grpc.StatusCode.ALREADY_EXISTS, 409, "conflict_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
])
def test_the_http_door_says_each_status_as_openai_does(code, status, kind):
    """pdq's gRPC refusals -> the HTTP door's (the e2e tests reach 400-429, 503 and 504 through a
    cluster; 403 has no generation path that raises it, so its mapping is checked here)."""
    import json

    from gateway.http_api import error_response, from_status

    err = from_status(StatusError(code, "what to do", reason="WHY", field="f", retry_ms=2500))
    assert (err.status, err.kind, err.code, err.param, err.message) == (status, kind, "WHY", "f", "what to do")
    resp = error_response(err)
    assert resp.status == status and json.loads(resp.body)["error"]["message"] == "what to do"
    assert resp.headers.get("Retry-After") == ("3" if status in (429, 503) else None)
