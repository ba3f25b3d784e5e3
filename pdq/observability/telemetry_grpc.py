"""gRPC plumbing of `pdq.observability.telemetry`: the server interceptor every pdq server runs (RPC metrics;
with tracing on, a SERVER span per call, continued from the caller's `traceparent`) and the
client interceptors that put the current span's `traceparent` on internal calls."""

import asyncio
import time

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from pdq.observability import metrics, telemetry

PUBLIC_SERVICES = ("pdq.v1.Generation", "pdq.v1.Operator")  # traced even when the caller sent no context


def _split_method(full: str) -> tuple[str, str]:
    service, _, method = full.lstrip("/").partition("/")
    return service, method


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Counts every pdq RPC (`pdq.observability.metrics`) and, with tracing on, runs it inside a SERVER span:
    continued from the caller's `traceparent` metadata, or a new root for the public API."""

    def __init__(self, tracing: bool):
        self.tracing = tracing

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/pdq."):
            return handler  # health checks and reflection stay out of traces and metrics
        service, method = _split_method(details.method)
        parent = None
        if self.tracing:
            parent = telemetry.context_of({k: v for k, v in (details.invocation_metadata or ()) if k == "traceparent"})
            if parent is None and service not in PUBLIC_SERVICES:
                parent = False  # an internal call outside any request: not traced
        return _wrap(handler, service, method, parent)


def _wrap(handler: grpc.RpcMethodHandler, service: str, method: str, parent) -> grpc.RpcMethodHandler:
    trace_it = parent is not False and telemetry.enabled()
    name = f"{service}/{method}"

    def begin():
        metrics.RPC_STARTED.labels(service, method).inc()
        if not trace_it:
            return None, None, time.perf_counter()
        span = telemetry.tracer().start_span(name, context=parent, kind=SpanKind.SERVER,
                                  attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})
        token = otel_context.attach(trace.set_span_in_context(span))
        return span, token, time.perf_counter()

    def finish(state, context, exc: BaseException | None, detach: bool = True) -> None:
        span, token, t0 = state
        code = _code_of(context, exc)
        metrics.RPC_HANDLED.labels(service, method, code.name).inc()
        metrics.RPC_SECONDS.labels(service, method).observe(time.perf_counter() - t0)
        if span is None:
            return
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            span.add_event("timeout", {"pdq.reason": "deadline exceeded"})
        elif code == grpc.StatusCode.CANCELLED and isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            span.add_event("cancelled", {"pdq.reason": "client disconnected"})
        if code != grpc.StatusCode.OK:
            details = ""
            try:
                details = context.details() or ""
            except Exception:  # details() is not on every context version
                pass
            if isinstance(details, bytes):
                details = details.decode(errors="replace")
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
        if detach and token is not None:  # streams: their task's context ends with the call
            otel_context.detach(token)
        span.end()

    def unary(inner):  # one response: the span ends when the handler returns
        async def call(request, context):
            state, exc = begin(), None
            try:
                return await inner(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                finish(state, context, exc)
        return call

    def streaming(inner):  # a response stream: the span ends when the stream is done or closed
        async def call(request, context):
            state, exc = begin(), None
            responses = inner(request, context)
            try:
                async for item in responses:
                    yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                try:
                    await _close(responses, state)
                finally:
                    finish(state, context, exc, detach=False)
        return call

    for kind, wrap, make in (("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
                             ("unary_stream", streaming, grpc.unary_stream_rpc_method_handler),
                             ("stream_unary", unary, grpc.stream_unary_rpc_method_handler),
                             ("stream_stream", streaming, grpc.stream_stream_rpc_method_handler)):
        inner = getattr(handler, kind)
        if inner:
            return make(wrap(inner), handler.request_deserializer, handler.response_serializer)
    return handler


async def _close(responses, state) -> None:
    """Runs a response generator's cleanup now, inside the call's span. When the client goes
    away mid-stream, grpc leaves the generator suspended and asyncio closes it later from
    another task (the async-generator finalizer): the span is made current there again."""
    span = state[0]
    if span is not None and trace.get_current_span() is not span:
        otel_context.attach(trace.set_span_in_context(span))  # that task's context ends with it
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except RuntimeError:  # already being closed by its own finalizer
            pass


def _code_of(context, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the client went away, or the deadline passed
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
    try:
        code = context.code()
    except Exception:
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the current span's `traceparent` added to its metadata."""
    value = telemetry.traceparent()
    if not value:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata["traceparent"] = value
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


# grpc.aio files an interceptor under one call type only: one class per type.
class _InjectUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _InjectUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_context(details), request)


class _InjectStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_with_context(details), request_iterator)


class _InjectStreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_with_context(details), request_iterator)


def context_injectors() -> list:
    return [_InjectUnaryUnary(), _InjectUnaryStream(), _InjectStreamUnary(), _InjectStreamStream()]


def server_interceptors() -> list:
    """Interceptors of every pdq gRPC server (RPC metrics always; spans when tracing is on)."""
    return [ServerInterceptor(telemetry.enabled())]


def client_interceptors() -> list | None:
    """Interceptors of pdq's internal channels: context propagation when tracing is on."""
    return context_injectors() if telemetry.enabled() else None
