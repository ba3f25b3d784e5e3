"""How the services and the model threads use the store, as mypy sees it (tests/test_typing.py):
every operation has its own result type, awaited on an AsyncStore and returned by a SyncStore."""

from typing import assert_type

from pdq.state.ending import Ending
from pdq.state.request import State
from pdq.state.store import (AsyncStore, Claimed, HandoffRecord, Moved, Sent, Snapshot, StepItem, Submitted,
                             SyncStore, TenantPolicy)
from pdq.v1 import internal_pb2 as pb


async def services(store: AsyncStore, spec: pb.RequestSpec) -> None:
    assert_type(await store.submit(spec), Submitted)
    assert_type(await store.snapshot(["standard"], 8, 4), Snapshot)
    assert_type(await store.claim([("r", "d1")], "p1"), list[Claimed])
    assert_type(await store.expire_deadlines(), int)
    assert_type(await store.next_deadline_ms(), int | None)
    assert_type(await store.lead("s1", 2000), tuple[int, str])
    assert_type(await store.handoffs("b1", [("p1", "d1", True)]), list[HandoffRecord])
    assert_type(await store.policy_and_seq("acme"), tuple[TenantPolicy, int])
    assert_type(await store.end("r", Ending.cancelled("operator")), State | None)
    assert_type(await store.list_requests(), tuple[list[str], str])
    assert_type(await store.streamed_tokens("r"), list[int])


def model_thread(store: SyncStore) -> None:
    assert_type(store.transition("r", 1, State.DECODING, decode_worker="d1"), Moved | bool)
    assert_type(store.step([StepItem("r", 1, 0, 7)]), list[bool])
    assert_type(store.send(SyncStore.step.build(store, [StepItem("r", 1, 0, 7)])), Sent[list[bool]])
    assert_type(store.send(SyncStore.step.build(store, [])).result(), list[bool])
    assert_type(store.step_and_transition([], [("r", 1, State.DECODING, {})]), tuple[list[bool], list[Moved | bool]])
    assert_type(store.requeue("r", 1, "oom", 3), str | None)
    assert_type(store.states(["r"]), list[State | None])
    assert_type(store.deadlines(["r"]), list[int])
