"""The one error type below a servicer: a gRPC status, a message a person can act on, and typed
details for programs."""

import grpc

ERROR_DOMAIN = "pdq.dev"


class StatusError(Exception):
    """Raised below a servicer to end the call with this status: a message a person can act
    on, plus typed details for programs (`google.rpc.ErrorInfo` with `reason`, and
    `google.rpc.RetryInfo` when `retry_ms` says a retry makes sense)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = (), *, reason: str = "",
                 field: str = "", retry_ms: int = 0):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing = trailing  # trailing metadata forwarded as is (e.g. from the scheduler)
        self.reason = reason
        self.field = field
        self.retry_ms = retry_ms

    def trailing_metadata(self) -> tuple:
        """The trailing metadata carrying the typed details (grpc-status-details-bin)."""
        if not self.reason and not self.retry_ms:
            return self.trailing
        from google.protobuf import any_pb2, duration_pb2
        from google.rpc import error_details_pb2, status_pb2

        details = []
        if self.reason:
            info = error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN,
                                               metadata={"field": self.field} if self.field else {})
            details.append(info)
        if self.retry_ms:
            retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
                seconds=self.retry_ms // 1000, nanos=(self.retry_ms % 1000) * 1_000_000))
            details.append(retry)
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        for d in details:
            packed = any_pb2.Any()
            packed.Pack(d)
            status.details.append(packed)
        extra = (("grpc-status-details-bin", status.SerializeToString()),)
        if self.retry_ms:
            extra += (("grpc-retry-pushback-ms", str(self.retry_ms)),)
        return tuple(kv for kv in self.trailing if kv[0] not in dict(extra)) + extra


async def abort(context: grpc.aio.ServicerContext, exc: StatusError) -> None:
    await context.abort(exc.code, exc.message, exc.trailing_metadata())
