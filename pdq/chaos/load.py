"""The seeded load: every planned request through the public gRPC API (the generated stubs), as a
careful real client would make it, recording everything its calls saw (`record.Outcome`).

- Every request carries its client request id, so any call can be retried: a Submit or a
  GenerateStream that failed UNAVAILABLE before it returned an id is sent again with the same id
  (it must come back as the same request); a stream that breaks UNAVAILABLE after it did is
  resumed with StreamResult from the next token index (a FAILED request's stream also ends
  UNAVAILABLE: a resumed stream that ends so is over once GetResult says the request ended).
- Cancels: right after Submit (queued), once GetResult shows PREFILLING/TRANSFERRING (prefill),
  after a few streamed tokens or once GetResult shows DECODING (decode); a stream's decode
  cancel either calls Cancel or closes the stream (the gateway cancels for a client that left).
  A cancel is noted before it is sent, so one whose answer is lost still counts as asked for.
- Deadlines ride on timeout_ms; an operator move (SetDeadline) extends a tight one at once.
- Every request ends with GetResult long-polls until it is done: the end the client learns.
- A request not ended `request_bound_s` after it started is given up (closing its stream, so
  it counts as cancelled by the client), and so is every open one when nothing progressed for
  2 x stall_s (the run stalled): both are reported as stalls.
"""

import asyncio
import random
import time
from collections import Counter

import grpc

from pdq.state import request
from pdq.chaos.cluster import CHANNEL_OPTIONS
from pdq.chaos.faults import Injector
from pdq.chaos.plan import MOVED_TO_MS, RequestPlan
from pdq.chaos.record import Call, Move, Outcome
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from pdq.v1 import operator_pb2 as op_pb
from pdq.v1 import operator_pb2_grpc as op_grpc

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
TERMINAL = {state.value for state in request.TERMINAL}
GET_WAIT_MS = 10_000
UNARY_TIMEOUT_S = 30.0
CHANNELS = 4
FINISH = {v: k.removeprefix("FINISH_REASON_") for k, v in gen_pb.FinishReason.items()}


class GaveUp(Exception):
    pass


def backoff_s(failures: int, rng: random.Random) -> float:
    """What a client waits before its next try: 50 ms doubling to 1 s, with jitter."""
    return min(1.0, 0.05 * 2 ** min(failures, 5)) * rng.uniform(0.5, 1.0)


class Stall:
    """Watches progress (tokens, ends, acceptances): a span without any while requests are
    outstanding, longer than stall_s, is a stall."""

    def __init__(self, clock, stall_s: float):
        self.clock = clock
        self.stall_s = stall_s
        self.progress = 0
        self.stalls: list[dict] = []  # {from, to, outstanding}
        self.aborted = asyncio.Event()

    def tick(self) -> None:
        self.progress += 1

    async def watch(self, outstanding, on_abort) -> None:
        last, since, current = self.progress, self.clock(), None
        while True:
            await asyncio.sleep(0.5)
            now, busy = self.clock(), outstanding()
            if self.progress != last or not busy:
                last, since, current = self.progress, now, None
                continue
            if now - since > self.stall_s:
                if current is None:
                    current = {"from": round(since, 1), "to": round(now, 1), "outstanding": len(busy),
                               "requests": sorted(busy)[:20]}
                    self.stalls.append(current)
                current["to"] = round(now, 1)
                if now - since > 2 * self.stall_s and not self.aborted.is_set():
                    current["aborted"] = True
                    self.aborted.set()
                    on_abort()


class Load:
    def __init__(self, target: str, plans: list[RequestPlan], prompts: tuple[str, ...], injector: Injector,
                 clock, concurrency: int, request_bound_s: float, stall_s: float, seed: int):
        self.target = target
        self.plans = plans
        self.prompts = prompts
        self.injector = injector
        self.clock = clock
        self.concurrency = concurrency
        self.request_bound_s = request_bound_s
        self.rng = random.Random(f"load-{seed}")
        self.outcomes: list[Outcome] = [Outcome(p.index, p.client_id) for p in plans]
        self.counts: Counter = Counter()  # (method, code) -> calls
        self.stall = Stall(clock, stall_s)
        self._open: dict[int, asyncio.Task] = {}
        injector.in_flight = lambda: len(self._open)
        self._channels: list[grpc.aio.Channel] = []

    async def run(self) -> list[Outcome]:
        self._channels = [grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS) for _ in range(CHANNELS)]
        watcher = asyncio.create_task(self.stall.watch(lambda: [self.plans[i].client_id for i in self._open],
                                                        self._abort))
        slots = asyncio.Semaphore(self.concurrency)
        try:
            for plan in self.plans:
                await self.injector.note_started(plan.index)
                await self.injector.wait_ready(plan.index)
                await slots.acquire()
                if self.stall.aborted.is_set():
                    slots.release()
                    self.outcomes[plan.index].abandoned = "not started: the run stalled"
                    continue
                task = asyncio.create_task(self._one(plan))
                self._open[plan.index] = task
                task.add_done_callback(lambda t, i=plan.index: (self._open.pop(i, None), slots.release()))
            await self.injector.finish()
            while self._open:
                await asyncio.gather(*list(self._open.values()), return_exceptions=True)
        finally:
            watcher.cancel()
            for channel in self._channels:
                await channel.close()
        return self.outcomes

    def _abort(self) -> None:
        for task in list(self._open.values()):
            task.cancel()

    def _stubs(self, plan: RequestPlan) -> tuple[gen_grpc.GenerationStub, op_grpc.OperatorStub]:
        channel = self._channels[plan.index % len(self._channels)]
        return gen_grpc.GenerationStub(channel), op_grpc.OperatorStub(channel)

    # -- one request ---------------------------------------------------------------------------

    async def _one(self, plan: RequestPlan) -> None:
        out = self.outcomes[plan.index]
        out.t_start = self.clock()
        try:
            await asyncio.wait_for(self._flow(plan, out), timeout=self.request_bound_s)
        except asyncio.TimeoutError:
            out.abandoned = f"not ended {self.request_bound_s:.0f}s after it started"
        except asyncio.CancelledError:
            out.abandoned = "given up: the run stalled"
        except GaveUp as exc:
            out.abandoned = str(exc)
        if out.abandoned and out.end_state not in TERMINAL:
            out.cancelled = out.cancelled or "abandon"  # an open stream of it was closed: the gateway may cancel it
        out.t_end = self.clock()

    async def _flow(self, plan: RequestPlan, out: Outcome) -> None:
        gen, op = self._stubs(plan)
        req = gen_pb.GenerateRequest(
            prompt=self.prompts[plan.prompt], request_id=plan.client_id, timeout_ms=plan.timeout_ms,
            sampling=gen_pb.SamplingParams(max_tokens=plan.max_tokens, temperature=0.0, ignore_eos=True))
        side: list[asyncio.Task] = []  # the duplicate submit, deadline move and cancel of a stream
        try:
            if plan.kind == "stream":
                await self._stream(plan, out, gen, op, req, side)
            else:
                resp = await self._unary(out, "Submit", lambda: gen.Submit(req, timeout=UNARY_TIMEOUT_S),
                                         retry=(UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED))
                if resp is not None:
                    self._accepted(out, resp.request_id, resp.created)
                    await self._after_accept(plan, out, gen, op, req)
                    if plan.cancel in ("queued", "prefill") or (plan.cancel == "decode" and plan.kind == "submit_get"):
                        await self._cancel_in_state(plan, out, gen)
                    if plan.kind == "submit_stream":
                        await self._stream(plan, out, gen, op, req, side)
            if not out.rids:
                out.not_accepted = f"{out.calls[-1].code}: {out.calls[-1].details}" if out.calls else "no answer"
                return
            for task in side:
                await task
            await self._final(out, gen)
        finally:
            for task in side:
                task.cancel()

    def _accepted(self, out: Outcome, rid: str, created: bool | None = None) -> None:
        if not out.rids:
            self.stall.tick()
        out.note_rid(rid)
        if created is not None:
            out.created.append(created)

    async def _after_accept(self, plan: RequestPlan, out: Outcome, gen, op, req) -> None:
        """The deadline move (at once: the first deadline is near) and the retry of the same
        client id, once the request has an id."""
        if plan.deadline == "moved":
            move = Move(self.clock(), MOVED_TO_MS, "")
            out.moves.append(move)
            resp = await self._unary(out, "SetDeadline", lambda: op.SetDeadline(
                op_pb.SetDeadlineRequest(request_id=out.rid, timeout_ms=MOVED_TO_MS), timeout=UNARY_TIMEOUT_S))
            move.code = "OK" if resp is not None else _last(out, "SetDeadline").code
            move.deadline_ms = resp.deadline_ms if resp is not None else 0
        if plan.duplicate:
            resp = await self._unary(out, "Submit", lambda: gen.Submit(req, timeout=UNARY_TIMEOUT_S))
            if resp is not None:
                self._accepted(out, resp.request_id, resp.created)

    async def _stream(self, plan: RequestPlan, out: Outcome, gen, op, req, side: list) -> None:
        """GenerateStream (or StreamResult from the start, for submit_stream), resumed with
        StreamResult from the next index whenever it breaks UNAVAILABLE, until it ends with the
        request's end: a last message, or the end's status. A FAILED request's status is
        UNAVAILABLE too: a resumed stream that was answered and then ends UNAVAILABLE is over
        if GetResult says the request ended."""
        failures = 0
        cancel_sent = False
        while True:
            answered = False
            if not out.rids:
                method, call = "GenerateStream", gen.GenerateStream(req)
            else:
                method = "StreamResult"
                call = gen.StreamResult(gen_pb.StreamResultRequest(request_id=out.rid, offset=len(out.tokens)))
                out.resumes += int(failures > 0)
            try:
                async for msg in call:
                    answered = True
                    if msg.request_id and not out.rids:
                        self._accepted(out, msg.request_id)
                        if plan.kind == "stream":
                            side.append(asyncio.create_task(self._after_accept(plan, out, gen, op, req)))
                    elif msg.request_id:
                        out.note_rid(msg.request_id)
                    if msg.HasField("index"):
                        out.messages.append([msg.index, len(msg.token_ids)])
                        out.tokens.extend(msg.token_ids)
                        out.t_first_token = out.t_first_token or self.clock()
                        self.stall.tick()
                    if msg.finish_reason:
                        out.stream_end = FINISH.get(msg.finish_reason, str(msg.finish_reason))
                    if plan.cancel == "decode" and not cancel_sent and len(out.tokens) >= plan.cancel_after:
                        cancel_sent = True
                        if plan.disconnect:
                            out.cancelled = "disconnect"
                            call.cancel()
                            out.calls.append(Call(method, "CANCELLED", "closed by the load to cancel",
                                                  round(self.clock(), 3), ours=True))
                            return
                        side.append(asyncio.create_task(self._cancel(out, gen)))
                self.counts[(method, "OK")] += 1
                return
            except grpc.aio.AioRpcError as exc:
                self._note(out, method, exc)
                retried = (UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED) if not out.rids else (UNAVAILABLE,)
                if exc.code() not in retried:
                    out.stream_end = exc.code().name
                    return
                if method == "StreamResult" and answered and await self._state(out, gen) in TERMINAL:
                    out.stream_end = exc.code().name
                    return
                await asyncio.sleep(backoff_s(failures, self.rng))
                failures += 1
            finally:
                call.cancel()  # no-op once it ended; a stream given up on is closed here

    async def _cancel_in_state(self, plan: RequestPlan, out: Outcome, gen) -> None:
        """Cancels once the request reaches the planned state (or has gone past it)."""
        if plan.cancel != "queued":
            wanted = {"prefill": {"PREFILLING", "TRANSFERRING"}, "decode": {"DECODING"}}[plan.cancel]
            stop_at = self.clock() + 10.0
            while self.clock() < stop_at:
                state = await self._state(out, gen)
                if state in wanted or state in TERMINAL or (plan.cancel == "prefill" and state == "DECODING"):
                    out.cancel_state = state
                    break
                await asyncio.sleep(0.005)
        await self._cancel(out, gen)

    async def _cancel(self, out: Outcome, gen) -> None:
        out.cancelled = "rpc"  # before it is sent: an answer lost on the way still means we asked
        resp = await self._unary(out, "Cancel", lambda: gen.Cancel(gen_pb.CancelRequest(request_id=out.rid),
                                                                   timeout=UNARY_TIMEOUT_S))
        if resp is not None:
            out.cancel_answer = resp.state

    async def _state(self, out: Outcome, gen) -> str:
        resp = await self._unary(out, "GetResult", lambda: gen.GetResult(
            gen_pb.GetResultRequest(request_id=out.rid, wait_ms=0), timeout=UNARY_TIMEOUT_S))
        return resp.state if resp is not None else ""

    async def _final(self, out: Outcome, gen) -> None:
        """GetResult long-polls until the request is done: the end the client learns."""
        if not out.rids:
            return
        while True:
            resp = await self._unary(out, "GetResult", lambda: gen.GetResult(
                gen_pb.GetResultRequest(request_id=out.rid, wait_ms=GET_WAIT_MS), timeout=GET_WAIT_MS / 1000 + 20))
            if resp is None:
                failed = _last(out, "GetResult")
                raise GaveUp(f"GetResult failed: {failed.code} {failed.details}")
            out.note_rid(resp.request_id)
            out.echoed_id = resp.client_request_id
            if resp.done:
                out.end_state, out.end_error = resp.state, resp.error
                out.end_tokens = list(resp.result.token_ids)
                self.stall.tick()
                return

    # -- calls ---------------------------------------------------------------------------------

    async def _unary(self, out: Outcome, method: str, send, retry=(UNAVAILABLE,)):
        """send() until it answers, retrying `retry` codes with backoff (and a GetResult that
        overran its own long-poll). -> the answer, or None after a status not retried."""
        failures = 0
        while True:
            try:
                resp = await send()
            except grpc.aio.AioRpcError as exc:
                self._note(out, method, exc)
                overran = method == "GetResult" and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if exc.code() not in retry and not overran:
                    return None
                await asyncio.sleep(backoff_s(failures, self.rng))
                failures += 1
                continue
            self.counts[(method, "OK")] += 1
            return resp

    def _note(self, out: Outcome, method: str, exc: grpc.aio.AioRpcError) -> None:
        self.counts[(method, exc.code().name)] += 1
        out.calls.append(Call(method, exc.code().name, (exc.details() or "")[:300], round(self.clock(), 3)))


def _last(out: Outcome, method: str) -> Call:
    """The last failed call of `method` (other calls of the request may have failed since)."""
    return next(c for c in reversed(out.calls) if c.method == method)


def monotonic_clock():
    """Seconds since now."""
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0
