"""gateway.submits.SubmitBatcher, the coalescing of the gateway's submits, with scripted sends
(the policy alone; the real scheduler answers SubmitMany in tests/scheduler/test_service.py)."""

import asyncio

import grpc
import pytest

from gateway.submits import SubmitBatcher, outcome_error
from pdq.v1 import internal_pb2 as pb


def request(rid: str) -> pb.SubmitRequest:
    return pb.SubmitRequest(spec=pb.RequestSpec(request_id=rid, tenant="t", prompt_token_ids=[1]))


def error(code: grpc.StatusCode, message: str = "no") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


class Scheduler:
    """Sends that block until released, recording what was sent how."""

    def __init__(self, many_error: grpc.aio.AioRpcError | None = None):
        self.sent: list[tuple[str, list[str]]] = []  # ("one" | "many", request ids)
        self.release = asyncio.Event()
        self.release_many = self.release  # SubmitMany answers when this is set
        self.many_error = many_error

    async def one(self, r: pb.SubmitRequest, timeout):
        self.sent.append(("one", [r.spec.request_id]))
        await self.release.wait()
        if r.spec.request_id.startswith("bad"):
            raise error(grpc.StatusCode.INVALID_ARGUMENT, f"{r.spec.request_id} refused")
        return pb.SubmitResponse(request_id=r.spec.request_id, created=True)

    async def many(self, r: pb.SubmitManyRequest, timeout):
        self.sent.append(("many", [i.spec.request_id for i in r.items]))
        await self.release_many.wait()
        if self.many_error is not None:
            raise self.many_error
        out = pb.SubmitManyResponse()
        for i in r.items:
            rid = i.spec.request_id
            if rid.startswith("bad"):
                out.items.add(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=f"{rid} refused",
                              trailing=[pb.MetadataEntry(key="grpc-retry-pushback-ms", value=b"250"),
                                        pb.MetadataEntry(key="grpc-status-details-bin", value=b"\x01\x02")])
            else:
                out.items.add(response=pb.SubmitResponse(request_id=rid, created=True))
        return out


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_submit_goes_at_once_in_a_submit_of_its_own():
    s = Scheduler()
    s.release.set()
    b = SubmitBatcher(s.one, s.many)
    assert (await b.submit(request("a"), 5)).request_id == "a"
    assert s.sent == [("one", ["a"])] and b.inflight == 0


async def test_submits_that_find_every_call_busy_go_together_each_answered_as_alone():
    s = Scheduler()
    b = SubmitBatcher(s.one, s.many, max_inflight=2)
    first = [asyncio.create_task(b.submit(request(r), 5)) for r in ("a", "b")]
    await settle()
    rest = [asyncio.create_task(b.submit(request(r), 5)) for r in ("c", "bad-d", "e")]
    await settle()
    assert s.sent == [("one", ["a"]), ("one", ["b"])]  # the others wait for one of these
    s.release.set()
    got = await asyncio.gather(*first, *rest, return_exceptions=True)
    assert s.sent[2] == ("many", ["c", "bad-d", "e"]) and len(s.sent) == 3
    assert [g.request_id for g in got if not isinstance(g, Exception)] == ["a", "b", "c", "e"]
    refused = got[3]
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.details() == "bad-d refused"
    assert dict(refused.trailing_metadata()) == {"grpc-retry-pushback-ms": "250", "grpc-status-details-bin": b"\x01\x02"}
    assert b.inflight == 0 and not b.waiting


async def test_a_waiting_submit_whose_timeout_passes_is_never_sent_and_gets_deadline_exceeded():
    s = Scheduler()
    b = SubmitBatcher(s.one, s.many, max_inflight=1)
    busy = asyncio.create_task(b.submit(request("a"), 5))
    await settle()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await b.submit(request("late"), 0.01)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s.release.set()
    assert (await busy).request_id == "a"
    await settle()
    assert s.sent == [("one", ["a"])]  # "late" was dropped before it could go


async def one_busy_two_waiting(s: Scheduler) -> tuple[SubmitBatcher, asyncio.Task, list[asyncio.Task]]:
    """A batcher with one call in flight ("a", its limit) and "b", "c" waiting; then released."""
    b = SubmitBatcher(s.one, s.many, max_inflight=1)
    busy = asyncio.create_task(b.submit(request("a"), 5))
    await settle()
    waiting = [asyncio.create_task(b.submit(request(r), 5)) for r in ("b", "c")]
    await settle()
    s.release.set()
    return b, busy, waiting


async def test_a_scheduler_without_submit_many_gets_single_submits_from_then_on():
    s = Scheduler(many_error=error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"))
    b, busy, waiting = await one_busy_two_waiting(s)
    got = await asyncio.gather(busy, *waiting)
    assert [g.request_id for g in got] == ["a", "b", "c"] and not b.many
    assert s.sent == [("one", ["a"]), ("many", ["b", "c"]), ("one", ["b"]), ("one", ["c"])]


async def test_a_submit_many_that_fails_as_a_whole_fails_each_of_its_submits_with_its_error():
    s = Scheduler(many_error=error(grpc.StatusCode.UNAVAILABLE, "scheduler gone"))
    _, busy, waiting = await one_busy_two_waiting(s)
    assert (await busy).request_id == "a"
    for task in waiting:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await task
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == "scheduler gone"


def test_an_outcome_of_every_status_code_becomes_that_code():
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        got = outcome_error(pb.SubmitOutcome(code=code.value[0], message="m"))
        assert got.code() == code and got.details() == "m"


async def test_a_waiting_submit_whose_caller_goes_away_leaves_no_answer_behind(caplog):
    """A caller cancelled after its submit went out in a batch: the batch's other answers still
    come, and the one nobody reads is dropped quietly (no 'exception was never retrieved')."""
    import gc
    import logging

    s = Scheduler()
    s.release_many = asyncio.Event()
    b = SubmitBatcher(s.one, s.many, max_inflight=1)
    busy = asyncio.create_task(b.submit(request("a"), 5))
    await settle()
    gone = asyncio.create_task(b.submit(request("bad-gone"), 5))
    kept = asyncio.create_task(b.submit(request("c"), 5))
    await settle()
    s.release.set()
    await busy
    await settle()
    assert s.sent[1] == ("many", ["bad-gone", "c"])  # out, not answered yet
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        s.release_many.set()
        assert (await kept).request_id == "c"
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_a_waiting_submit_sent_alone_runs_in_its_callers_context():
    """Its Submit's span is then in its request's trace (the trace context is a contextvar)."""
    import contextvars

    caller = contextvars.ContextVar("caller", default="none")
    seen: list[str] = []
    s = Scheduler()
    plain_one = s.one

    async def one(r, timeout):
        seen.append(caller.get())
        return await plain_one(r, timeout)

    b = SubmitBatcher(one, s.many, max_inflight=1)

    async def submit_as(name: str, rid: str):
        caller.set(name)
        return await b.submit(request(rid), 5)

    busy = asyncio.create_task(submit_as("first", "a"))
    await settle()
    alone = asyncio.create_task(submit_as("second", "b"))  # waits, then goes alone
    await settle()
    s.release.set()
    assert [(await busy).request_id, (await alone).request_id] == ["a", "b"]
    assert seen == ["first", "second"] and s.sent == [("one", ["a"]), ("one", ["b"])]
