"""Every Lua script of pdq.state.keys is safe to run twice in a row: a `pdq.state.redisconn` client re-sends a
command whose reply was lost, so the first run may have been applied. Each case runs one store
call with its script sent twice, with the same arguments, and checks that the second run leaves
Redis as the first left it and answers consistently: the same answer, or, for a sweep (whose
answer counts what that run did) and for QUARANTINE (whose answer says whether that run did it),
that it found nothing left to do."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pdq.state.keys import SCRIPTS
from pdq.state.registry import WorkerInfo, heartbeat
from pdq.state.request import State
from pdq.state.ending import LOST, Ending
from pdq.state.calls import Call, Script
from pdq.state.store import SyncStore, StepItem, now_ms
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb


def spec(rid: str, tenant: str = "acme", deadline_ms: int = 0) -> pb.RequestSpec:
    return pb.RequestSpec(request_id=rid, tenant=tenant, tier="interactive", prompt_token_ids=[1, 2, 3],
                          sampling=gen_pb.SamplingParams(max_tokens=4, seed=1), arrival_ms=1,
                          deadline_ms=deadline_ms, content_hash="h1", client_request_id="client-" + rid)


def dump(client, prefix: str) -> dict:
    """Every key of the prefix with its value (not its expiry)."""
    read = {b"hash": client.hgetall, b"set": lambda k: sorted(client.smembers(k)), b"string": client.get,
            b"zset": lambda k: client.zrange(k, 0, -1, withscores=True), b"stream": client.xrange,
            b"list": lambda k: client.lrange(k, 0, -1)}
    return {key: read[client.type(key)](key) for key in sorted(client.scan_iter(match=prefix + ":*"))}


@dataclass
class Replayed:
    name: str
    first: Any
    second: Any
    after_first: dict
    after_second: dict


def run_twice(store: SyncStore, call: Callable[[SyncStore], Any]) -> Replayed:
    """Runs `call(store)`, whose one script goes to Redis twice with the same arguments."""
    seen: list[Replayed] = []
    plain = store.run

    def twice(sent: Call[Any]) -> Any:
        assert len(sent.parts) == 1 and isinstance(sent.parts[0], Script), "one script per call"
        name, args = sent.parts[0].name, sent.parts[0].args
        script = store._scripts[name]
        first = script(keys=[], args=[store.keys.prefix, *args])
        after_first = dump(store.client, store.keys.prefix)
        second = script(keys=[], args=[store.keys.prefix, *args])
        seen.append(Replayed(name, first, second, after_first, dump(store.client, store.keys.prefix)))
        return sent.parse([first])
    store.run = twice  # type: ignore[method-assign]
    try:
        call(store)
    finally:
        store.run = plain  # type: ignore[method-assign]
    assert len(seen) == 1, "one script per call"
    return seen[0]


def claimed(store: SyncStore, rid: str = "r", prefill: str = "p1", decode: str = "d1") -> int:
    store.submit(spec(rid))
    return store.claim([(rid, decode)], prefill)[0].epoch


def decoding(store: SyncStore, rid: str = "r") -> None:
    claimed(store, rid)
    store.step([StepItem(rid, 1, 0, 7, "a")])
    store.transition(rid, 1, State.DECODING, decode_worker="host:2")


def beating(store: SyncStore) -> None:
    heartbeat(store, WorkerInfo("d1", "decode", "host:2", free_slots=3, capacity=4), ttl_s=60)


def failed_handoffs(store: SyncStore) -> None:
    store.handoffs("batch-0", [("p1", "d1", False), ("p1", "d2", False)])


# (script, what it needs first, the call; "same": the replay answers as the first run,
#  else the replay's answer: it found nothing left to do)
CASES: list[tuple[str, Callable[[SyncStore], Any], Callable[[SyncStore], Any], Any]] = [
    ("submit", lambda s: None, lambda s: s.submit(spec("r"), "key-1"), "same"),
    ("claim", lambda s: s.submit(spec("r")), lambda s: s.claim([("r", "d1")], "p1"), "same"),
    ("requeue", claimed, lambda s: s.requeue("r", 1, "KV hand-off failed", 3), "same"),
    ("requeue", claimed, lambda s: s.requeue("r", 1, "KV hand-off failed", 1), "same"),  # its last attempt: FAILED
    ("requeue", claimed, lambda s: s.requeue("r", 1, "worker shutting down", 3, kind=LOST), "same"),
    ("transition", claimed, lambda s: s.transition("r", 1, State.DECODING, decode_worker="host:2"), "same"),
    ("step", claimed, lambda s: s.step([StepItem("r", 1, 0, 7, "a"), StepItem("r", 1, 1, 8, "b"),
                                        StepItem("r", 1, 2, 9, "c", State.COMPLETED, "length")]), "same"),
    ("finish", decoding, lambda s: s.end("r", Ending(State.CANCELLED, "cancelled", "cancelled by client")), "same"),
    ("expire_deadlines", lambda s: s.submit(spec("r", deadline_ms=1)), lambda s: s.expire_deadlines(), 0),
    ("reap_worker", decoding, lambda s: s.reap_worker("d1", 3), [0, 0]),
    ("expire_leases", lambda s: (s.submit(spec("r")), s.claim([("r", "d1")], "p1", lease_ms=-1)),
     lambda s: s.expire_leases(3), [0, 0]),
    ("snapshot", lambda s: s.submit(spec("r")), lambda s: s.snapshot(["interactive"], 4, 4), "same"),
    ("cancel_tenant", decoding, lambda s: s.end_tenant("acme", Ending.cancelled("operator")), 0),
    ("set_deadline", decoding, lambda s: s.set_deadline("r", now_ms() + 60_000), "same"),
    ("list_requests", decoding, lambda s: s.list_requests(), "same"),
    ("heartbeat", lambda s: s.submit(spec("r")), beating, "same"),
    ("workers", beating, lambda s: s.workers(("prefill", "decode"), 0), "same"),
    ("handoffs", lambda s: None, failed_handoffs, "same"),
    ("quarantine", failed_handoffs, lambda s: s.quarantine("p1", now_ms() + 30_000, "3 failed", 0), 0),
    ("lead", lambda s: None, lambda s: s.lead("sched-a", 60_000), "same"),
    ("resign", lambda s: s.lead("sched-a", 60_000), lambda s: s.resign("sched-a"), 0),
]


def test_every_script_has_a_replay_case():
    assert {name for name, *_ in CASES} == set(SCRIPTS)


@pytest.mark.parametrize("name, setup, call, replay", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_script_run_twice_in_a_row_changes_nothing_the_second_time_and_answers_consistently(
        redis_client, prefix, name, setup, call, replay):
    store = SyncStore(redis_client, prefix, result_ttl_s=60)
    setup(store)
    got = run_twice(store, call)
    assert got.name == name
    assert got.after_second == got.after_first
    if replay == "same":
        assert got.second == got.first
    else:
        assert got.second == replay and got.first != replay  # the first run did it; the replay found it done


def test_a_replayed_claim_hands_out_the_same_attempt_instead_of_dropping_it(redis_client, prefix):
    store = SyncStore(redis_client, prefix, result_ttl_s=60)
    store.submit(spec("r"))
    got = run_twice(store, lambda s: s.claim([("r", "d1")], "p1"))
    assert got.second == got.first and got.first[0][0] == 1 and got.first[0][1]  # epoch 1 and its spec, twice
    assert store.record("r")["attempts"] == "1" and store.record("r")["state"] == "PREFILLING"
    assert store.claim([("r", "d1")], "p1")[0].epoch == 0  # another dispatcher's claim: no longer queued


def test_a_replayed_submit_answers_created_and_a_clients_retry_answers_existing(redis_client, prefix):
    store = SyncStore(redis_client, prefix, result_ttl_s=60)
    got = run_twice(store, lambda s: s.submit(spec("r"), "key-1"))
    assert got.first == got.second == [1, b"r"]
    retry = store.submit(spec("r2"), "key-1")  # the same client id again, from a client: the first request
    assert (retry.kind, retry.request_id) == ("existing", "r")
