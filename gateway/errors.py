"""How the gateway's calls end when they do not end OK: refusals counted, the scheduler's answers
forwarded as they are, and the gateway's own failures (the scheduler or Redis out of reach, the
gateway stopping) as UNAVAILABLE with a retry hint and, for an accepted request, where to pick
it up: those never touch the request (only a client that leaves cancels its request)."""

import functools
import inspect

import grpc

from gateway.follower import FollowerUnavailable
from pdq.observability import metrics, telemetry
from pdq.state import redisconn
from pdq.transport.status import StatusError, abort

RETRY_MS = 1000  # the retry hint of a call the gateway could not serve now
# Statuses of the scheduler that are answers, forwarded as they are (with their details).
FORWARDED = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND})
DETAILS = ("grpc-retry-pushback-ms", "grpc-status-details-bin")


def rpc(method):
    """Turns StatusError raised below a servicer method into the call's status (pdq.transport.rpc_guard
    maps the rest), counting refusals."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except StatusError as exc:
                note_refusal(exc)
                await abort(context, exc)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except StatusError as exc:
            note_refusal(exc)
            await abort(context, exc)
    return unary


REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}


def note_refusal(exc: StatusError) -> None:
    """Counts a request refused at the door (metric by reason, event on the call's span)."""
    if exc.code not in REFUSALS:
        return
    reason = exc.reason or _forwarded_reason(exc) or exc.code.name
    metrics.REJECTIONS.labels(reason).inc()
    telemetry.event("rejected", {"pdq.reason": reason, "pdq.error": exc.message})


def _forwarded_reason(exc: StatusError) -> str:
    """The ErrorInfo reason of an error forwarded from the scheduler, if any."""
    raw = dict(exc.trailing).get("grpc-status-details-bin")
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not raw:
        return "QUEUE_FULL"
    if not raw:
        return ""
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status.FromString(raw)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def scheduler_error(exc: grpc.aio.AioRpcError, retry: str) -> StatusError:
    """The status a failed call to the scheduler gives the client's call: the scheduler's answers
    (FORWARDED, or an UNAVAILABLE carrying its own retry hint) as they are, details included;
    the scheduler unreachable or not answering in time: UNAVAILABLE with a retry hint. `retry`
    tells the client how to retry safely."""
    code = exc.code()
    trailing = tuple((k, v) for k, v in (exc.trailing_metadata() or ()) if k in DETAILS)
    if code in FORWARDED or (code == grpc.StatusCode.UNAVAILABLE and dict(trailing).get(DETAILS[1])):
        return StatusError(code, exc.details() or code.name, trailing)  # the details carry this very message
    return StatusError(grpc.StatusCode.UNAVAILABLE, f"scheduler unreachable ({code.name}: {exc.details()}); {retry}",
                       reason="SCHEDULER_UNAVAILABLE", retry_ms=RETRY_MS)


def raise_resumable(exc: BaseException, how: str) -> None:
    """Raises `resumable(exc, how)` in place of `exc` when it is the gateway's own failure;
    returns otherwise (the caller re-raises `exc`)."""
    own = resumable(exc, how)
    if own is not None:
        raise own from None


def resumable(exc: BaseException, how: str) -> StatusError | None:
    """UNAVAILABLE with a retry hint when `exc` is the gateway's own failure to follow a request
    (Redis unreachable past the outage window, the gateway stopping), else None: the request is
    untouched and `how` tells the client where to pick it up."""
    if isinstance(exc, FollowerUnavailable):
        reason = exc.reason
    elif redisconn.unavailable(exc):
        reason = "REDIS_UNAVAILABLE"
    else:
        return None
    return StatusError(grpc.StatusCode.UNAVAILABLE, f"{exc}; the request goes on: {how}", reason=reason,
                       retry_ms=RETRY_MS)
