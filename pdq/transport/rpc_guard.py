"""The guard every pdq gRPC server runs: no call of any pdq service ends UNKNOWN or INTERNAL.

For every `/pdq.*` method it
- refuses calls until the server is ready (its model loaded and warm, its Redis reached) with
  UNAVAILABLE and a retry hint: a worker restarted under the address the registry still names
  gets calls before it can serve them;
- parses the request itself: a message that does not parse (e.g. invalid UTF-8 in a string
  field) gets INVALID_ARGUMENT naming the field, not a parse error from inside gRPC;
- maps what the handler raises: `StatusError` -> its status; Redis unreachable (past the
  outage window, `pdq.state.redisconn`) -> UNAVAILABLE with a retry hint; anything else is a bug:
  logged with its traceback, counted (`pdq_rpc_unexpected_errors_total`), and answered
  UNAVAILABLE with a retry hint, so the caller retries instead of failing on UNKNOWN.
"""

import asyncio
import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from pdq.observability import metrics
from pdq.state import redisconn
from pdq.transport.status import StatusError

log = logging.getLogger("pdq.rpc")

NOT_READY_RETRY_MS = 1000
REDIS_RETRY_MS = 1000
BUG_RETRY_MS = 1000


class BadRequest:
    """A request that did not parse; `error` says why, naming the field when one is to blame."""

    def __init__(self, error: StatusError):
        self.error = error


def describe_bad_message(raw: bytes, cls: type[Message]) -> StatusError:
    """Why `raw` is not a valid `cls`: INVALID_ARGUMENT naming the string field that holds
    invalid UTF-8 (found by parsing `raw` with every string field read as bytes), else the
    message type."""
    name = cls.DESCRIPTOR.name
    try:
        twin = _bytes_twin(cls.DESCRIPTOR.full_name)()
        twin.ParseFromString(raw)
        path = _bad_utf8(twin, cls.DESCRIPTOR, "")
    except Exception:  # not even the wire format is right
        path = None
    if path is None:
        return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name} message",
                           reason="MALFORMED_REQUEST")
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{path}: is not valid UTF-8 (string fields must be UTF-8 text)",
                       reason="INVALID_UTF8", field=path)


def _bad_utf8(msg: Message, desc: Any, prefix: str) -> str | None:
    """The path of the first string field (per `desc`, the real descriptor) whose bytes are not UTF-8."""
    for field, value in msg.ListFields():
        real = desc.fields_by_name[field.name]
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated
        values = list(value) if repeated else [value]
        for i, v in enumerate(values):
            at = f"{path}[{i}]" if repeated else path
            if real.type == real.TYPE_STRING:
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError:
                    return at
            elif real.type == real.TYPE_MESSAGE and not real.message_type.GetOptions().map_entry:
                found = _bad_utf8(v, real.message_type, at + ".")
                if found:
                    return found
    return None


@cache
def _bytes_twin(full_name: str) -> type[Message]:
    """The message class `full_name` with every string field declared bytes (a pool of its own)."""
    from google.protobuf import symbol_database

    real = symbol_database.Default().pool.FindMessageTypeByName(full_name)
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file_desc: Any) -> None:
        if file_desc.name in added:
            return
        for dep in file_desc.dependencies:
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        file_desc.CopyToProto(proto)
        for message in proto.message_type:
            _strings_to_bytes(message)
        pool.Add(proto)
        added.add(file_desc.name)

    add(real.file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(full_name))


def _strings_to_bytes(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        if field.type == field.TYPE_STRING:
            field.type = field.TYPE_BYTES
    for nested in message.nested_type:
        _strings_to_bytes(nested)


def _safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    cls = getattr(deserialize, "__self__", None)
    if deserialize is None or not (isinstance(cls, type) and issubclass(cls, Message)):
        return deserialize

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError:
            return BadRequest(describe_bad_message(raw, cls))
    return parse


def status_of(exc: BaseException, method: str) -> StatusError:
    """The status a handler's exception ends its call with."""
    if isinstance(exc, StatusError):
        return exc
    if redisconn.unavailable(exc):
        return StatusError(grpc.StatusCode.UNAVAILABLE, f"Redis unreachable ({exc}); retry",
                           reason="REDIS_UNAVAILABLE", retry_ms=REDIS_RETRY_MS)
    log.error("unexpected error in %s", method, exc_info=exc)
    metrics.RPC_UNEXPECTED.labels(method).inc()
    return StatusError(grpc.StatusCode.UNAVAILABLE, f"unexpected server error ({type(exc).__name__}: {exc}); "
                       "it is logged; retry", reason="SERVER_ERROR", retry_ms=BUG_RETRY_MS)


def _passes(exc: BaseException) -> bool:
    """Exceptions that already carry the call's outcome: an abort, a cancelled call."""
    return isinstance(exc, (asyncio.CancelledError, GeneratorExit)) or type(exc).__name__ == "AbortError"


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """`ready()`: whether the server may serve calls now."""

    def __init__(self, ready: Callable[[], bool]):
        self.ready = ready

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/pdq."):
            return handler
        return _guard(handler, details.method, self.ready)


def _guard(handler: grpc.RpcMethodHandler, method: str, ready: Callable[[], bool]) -> grpc.RpcMethodHandler:
    async def refuse(context: grpc.aio.ServicerContext, exc: StatusError) -> None:
        await context.abort(exc.code, exc.message, exc.trailing_metadata())

    async def check(request: Any, context: grpc.aio.ServicerContext) -> None:
        if not ready():
            await refuse(context, StatusError(grpc.StatusCode.UNAVAILABLE, "not serving yet or any more (starting up: "
                                              "model loading, Redis not reached; or shutting down); retry",
                                              reason="NOT_READY", retry_ms=NOT_READY_RETRY_MS))
        if isinstance(request, BadRequest):
            await refuse(context, request.error)

    async def failed(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        """Ends the call with the status `exc` stands for (an abort or a cancel passes as it is)."""
        if _passes(exc):
            raise exc
        await refuse(context, status_of(exc, method))

    deserialize = _safe_deserializer(handler.request_deserializer)
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary_response(request, context):
            await check(request if handler.unary_unary else None, context)
            try:
                return await inner(request, context)
            except BaseException as exc:
                await failed(exc, context)
        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary_response, deserialize, handler.response_serializer)
    inner_stream = handler.unary_stream or handler.stream_stream

    async def stream_response(request, context):
        await check(request if handler.unary_stream else None, context)
        try:
            async for item in inner_stream(request, context):
                yield item
        except BaseException as exc:
            await failed(exc, context)
    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(stream_response, deserialize, handler.response_serializer)
