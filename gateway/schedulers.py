"""The scheduler replicas a gateway calls (`--scheduler-address a:1,b:2`).

Every replica serves Submit and Cancel, whichever of them leads (`scheduler.leader`). A call goes
to the replica that answered last; when that one is unreachable (UNAVAILABLE: it died, restarts or
is partitioned off) the same message goes to the next, in the listed order. With one address (a
Kubernetes Service in front of the replicas) a call that did not reach a scheduler is sent once
more, waiting up to RECONNECT_S for the channel to reconnect (to another replica behind the
Service, or to a restarted one). Both calls are safe to send twice: a submit's spec carries the
request id the gateway gave it (a second submit of it answers `created=False`, the same request),
and a cancel of an ended request changes nothing.
"""

import grpc

from gateway.submits import SubmitBatcher
from pdq.transport import mtls
from pdq.observability import telemetry_grpc
from pdq.transport.serving import GRPC_OPTIONS
from pdq.v1 import internal_pb2 as pb
from pdq.v1 import internal_pb2_grpc as pb_grpc

RECONNECT_S = 5.0


def reached(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a scheduler answered the error itself (with pdq's typed details: e.g. Redis is
    down, or it is stopping), rather than the call not reaching one."""
    return any(key == "grpc-status-details-bin" for key, _ in exc.trailing_metadata() or ())


class Schedulers:
    """A `SchedulerStub` look-alike (Submit, Cancel) over one channel per replica."""

    def __init__(self, addresses: list[str], tls: mtls.InternalTLS | None = None):
        self.addresses = addresses
        self.channels = [mtls.aio_channel(a, tls, GRPC_OPTIONS, interceptors=telemetry_grpc.client_interceptors())
                         for a in addresses]
        self.stubs = [pb_grpc.SchedulerStub(c) for c in self.channels]
        self.current = 0  # the replica that answered last
        self.submits = SubmitBatcher(lambda r, t: self._call("Submit", r, t),
                                     lambda r, t: self._call("SubmitMany", r, t))

    async def Submit(self, request: pb.SubmitRequest, timeout: float | None = None) -> pb.SubmitResponse:
        """Submits one request; those at hand together go in one call (`gateway.submits`)."""
        return await self.submits.submit(request, timeout)

    async def Cancel(self, request: pb.InternalCancelRequest, timeout: float | None = None) -> pb.InternalCancelResponse:
        return await self._call("Cancel", request, timeout)

    async def _call(self, method: str, request, timeout: float | None):
        first = self.current
        error: grpc.aio.AioRpcError | None = None
        for i in range(len(self.stubs)):
            k = (first + i) % len(self.stubs)
            try:
                reply = await getattr(self.stubs[k], method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                error = exc
                continue
            self.current = k
            return reply
        assert error is not None
        if len(self.stubs) == 1 and not reached(error):
            try:
                return await getattr(self.stubs[0], method)(request, wait_for_ready=True,
                                                            timeout=min(timeout or RECONNECT_S, RECONNECT_S))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
        raise error

    async def close(self) -> None:
        await self.submits.close()
        for channel in self.channels:
            await channel.close()
