"""The gateway's submits to the scheduler, coalesced: those at hand go in one call.

A submit that finds fewer than `max_inflight` calls to the scheduler in flight goes at once, in a
`Submit` of its own: a lone request never waits. One that finds them all busy waits, and when a
call returns, everything waiting goes together in one `SubmitMany` (up to `max_batch`). Under
load the gateway then makes one call per round trip instead of one per request, and the
scheduler writes a batch to Redis in two round trips instead of two per request (as vLLM's
engine client, or any RPC batcher, sends what accumulated while the last call was out).

Each submit is answered as a `Submit` of its own would be: its `SubmitResponse`, or its error as
a `grpc.aio.AioRpcError` with the scheduler's status, message and details; a submit whose own
timeout passes first gets DEADLINE_EXCEEDED (one still waiting is not sent). A scheduler that
does not know `SubmitMany` (an older one, during an upgrade) gets single `Submit`s from then on.
A `Submit` of one request runs in its caller's context, so its span is in the request's trace;
a `SubmitMany` is in no request's trace (each request's spec carries its own trace context).
"""

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from pdq.v1 import internal_pb2 as pb

log = logging.getLogger("pdq.gateway")

MAX_BATCH = 64  # submits in one SubmitMany
MAX_INFLIGHT = 2  # calls to the scheduler at once; more submits wait for one of them to return

SendOne = Callable[[pb.SubmitRequest, float | None], Awaitable[pb.SubmitResponse]]
SendMany = Callable[[pb.SubmitManyRequest, float | None], Awaitable[pb.SubmitManyResponse]]


def outcome_error(outcome: pb.SubmitOutcome) -> grpc.aio.AioRpcError:
    """A refused item of a SubmitMany as the error a Submit of its own raises."""
    code = next((c for c in grpc.StatusCode if c.value[0] == outcome.code), grpc.StatusCode.UNKNOWN)
    trailing = grpc.aio.Metadata(*((e.key, e.value if e.key.endswith("-bin") else e.value.decode())
                                   for e in outcome.trailing))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, outcome.message)


def timed_out() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "Deadline Exceeded")


@dataclass
class _Waiting:
    request: pb.SubmitRequest
    deadline: float | None  # loop time
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    context: contextvars.Context = field(default_factory=contextvars.copy_context)  # its call's (its trace)


class SubmitBatcher:
    def __init__(self, send_one: SendOne, send_many: SendMany, max_batch: int = MAX_BATCH,
                 max_inflight: int = MAX_INFLIGHT):
        self.send_one = send_one
        self.send_many = send_many
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self.many = True  # the scheduler answers SubmitMany (False once one said UNIMPLEMENTED)
        self.inflight = 0
        self.waiting: list[_Waiting] = []
        self.calls = 0  # calls made (Submit or SubmitMany)
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, request: pb.SubmitRequest, timeout: float | None) -> pb.SubmitResponse:
        loop = asyncio.get_running_loop()
        if self.inflight < self.max_inflight and not self.waiting:
            self.inflight += 1
            self.calls += 1
            try:
                return await self.send_one(request, timeout)
            finally:
                self.inflight -= 1
                self._drain()
        item = _Waiting(request, None if timeout is None else loop.time() + timeout)
        self.waiting.append(item)
        try:
            return await asyncio.wait_for(asyncio.shield(item.done), timeout)
        except asyncio.TimeoutError:
            raise timed_out() from None
        finally:
            if item in self.waiting:  # not sent (timed out, or its caller went away): it never will be
                self.waiting.remove(item)
            item.done.cancel()  # answered already, or nobody is left to read the answer of its batch

    def _drain(self) -> None:
        """Sends what waits, while fewer than max_inflight calls are out."""
        while self.waiting and self.inflight < self.max_inflight:
            batch, self.waiting = self.waiting[:self.max_batch], self.waiting[self.max_batch:]
            self.inflight += 1
            self.calls += 1
            # a call of its own, in no request's trace (each item's spec carries its own)
            task = asyncio.get_running_loop().create_task(self._send(batch), context=contextvars.Context())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Waiting]) -> None:
        loop = asyncio.get_running_loop()
        deadlines = [w.deadline for w in batch]
        timeout = None if None in deadlines else max(0.001, max(deadlines) - loop.time())  # type: ignore[type-var]
        results: list = []
        try:
            if len(batch) == 1 or not self.many:
                results = await self._each(batch, timeout)
            else:
                results = await self._many(batch, timeout)
        except Exception as exc:  # the call failed as a whole: every item fails with it
            results = [exc] * len(batch)
        finally:
            self.inflight -= 1
            for i, w in enumerate(batch):
                if w.done.done():
                    continue
                got = results[i] if i < len(results) else grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "the gateway is stopping")
                if isinstance(got, BaseException):
                    w.done.set_exception(got)
                else:
                    w.done.set_result(got)
        self._drain()

    async def _many(self, batch: list[_Waiting], timeout: float | None) -> list:
        try:
            reply = await self.send_many(pb.SubmitManyRequest(items=[w.request for w in batch]), timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("the scheduler does not serve SubmitMany; submitting one request per call")
            self.many = False
            return await self._each(batch, timeout)
        if len(reply.items) != len(batch):
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"SubmitMany answered {len(reply.items)} items of {len(batch)}")
        return [o.response if o.code == 0 else outcome_error(o) for o in reply.items]

    async def _each(self, batch: list[_Waiting], timeout: float | None) -> list:
        """A Submit of its own for each, in its caller's context: its call's span continues the
        request's trace, as a submit sent at once does."""
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*(loop.create_task(self.send_one(w.request, timeout), context=w.context)
                                      for w in batch), return_exceptions=True)

    async def close(self) -> None:
        """Waits for the calls in flight (their submits are answered)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
