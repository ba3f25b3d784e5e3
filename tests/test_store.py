"""The Lua scripts of pdq.state.keys against a real Redis server: a request's life as workers see it.
(Queue structure, fair-share counters, admission and leases: tests/scheduler/.)"""

import pytest

from pdq.state.ending import Ending
from pdq.state.request import State
from pdq.state.store import Moved, QueueLimits, SyncStore, StepItem
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb


def make_spec(rid: str, tenant: str = "acme", prompt=(1, 2, 3), max_tokens: int = 4, deadline_ms: int = 0):
    return pb.RequestSpec(request_id=rid, tenant=tenant, tier="interactive", prompt_token_ids=list(prompt),
                          sampling=gen_pb.SamplingParams(max_tokens=max_tokens, seed=1), arrival_ms=1,
                          deadline_ms=deadline_ms)


@pytest.fixture
def store(redis_client, prefix):
    return SyncStore(redis_client, prefix, result_ttl_s=60)


def tokens(store, rid):
    return [(int(f[b"i"]), int(f[b"t"]), f[b"x"].decode()) for _, f in store.client.xrange(store.keys.output(rid)) if b"i" in f]


def queued(store, tenant="acme"):
    return [x.decode() for x in store.client.zrange(store.keys.queue("interactive", tenant), 0, -1)]


def claim(store, rid, worker="w"):
    return store.claim([(rid, "d")], worker)[0].epoch


def test_submit_queues_once_per_idempotency_key(store):
    assert store.submit(make_spec("r1"), "client-key").request_id == "r1"
    again = store.submit(make_spec("r2"), "client-key")
    assert (again.kind, again.request_id) == ("existing", "r1")
    assert store.submit(make_spec("r3", tenant="other"), "client-key").kind == "created"
    assert store.submit(make_spec("r1")).kind == "existing"  # the same request id twice
    assert queued(store) == ["r1"] and queued(store, "other") == ["r3"]
    assert store.record("r1")["state"] == "QUEUED"


def test_a_reused_id_with_other_content_is_a_conflict_and_the_record_keeps_the_clients_id(store):
    def hashed(rid, digest, prompt=(1, 2, 3)):
        spec = make_spec(rid, prompt=prompt)
        spec.content_hash = digest
        return spec
    assert store.submit(hashed("r1", "d1"), "my-id").kind == "created"
    assert store.record("r1")["client_request_id"] == "my-id" and store.record("r1")["content_hash"] == "d1"
    retry = store.submit(hashed("r2", "d1"), "my-id")
    assert (retry.kind, retry.request_id) == ("existing", "r1")
    other = store.submit(hashed("r3", "d2", prompt=(9,)), "my-id")
    assert (other.kind, other.request_id) == ("conflict", "r1")
    assert store.submit(hashed("r1", "d2")).kind == "conflict"  # the same internal id, other content
    assert store.submit(make_spec("r4"), "my-id").kind == "existing"  # no digest (an older gateway): no conflict
    assert store.record("r3") == {} and queued(store) == ["r1"]


def test_submit_rejects_over_the_queue_bound(store):
    assert store.submit(make_spec("a"), limits=QueueLimits(max_queued=1)).kind == "created"
    got = store.submit(make_spec("b"), limits=QueueLimits(max_queued=1))
    assert (got.kind, got.reason) == ("rejected", "QUEUE_FULL")
    assert store.record("b") == {}


def test_claim_step_finish_and_stale_epochs(store):
    store.submit(make_spec("r"))
    assert claim(store, "r", "w1") == 1
    assert claim(store, "r", "w1") == 0  # already claimed
    assert store.step([StepItem("r", 1, 0, 7, "a")]) == [True]
    assert store.step([StepItem("r", 1, 0, 7, "a")]) == [True]  # a replayed index is ignored
    assert store.step([StepItem("r", 0, 1, 8, "b")]) == [False]  # stale epoch rejected
    assert store.step([StepItem("r", 1, 1, 8, "b", State.COMPLETED, "length")]) == [True]
    assert tokens(store, "r") == [(0, 7, "a"), (1, 8, "b")]
    rec = store.record("r")
    assert rec["state"] == "COMPLETED" and rec["finish_reason"] == "length" and rec["n_out"] == "2"
    # exactly one terminal state: later ends change nothing
    assert store.end("r", Ending(State.CANCELLED, "cancelled")) == State.COMPLETED
    assert store.step([StepItem("r", 1, 2, 9, "c")]) == [False]
    assert 0 < store.client.ttl(store.keys.request("r")) <= 60


def test_an_end_entry_carries_the_usage_its_reader_would_read_from_the_record(store):
    """The gateway answers a stream's end without another read: the end entry holds the
    record's usage and timing fields, and they give the same Usage and Timings."""
    import asyncio

    from gateway.results import USAGE_FIELDS, Event, usage_and_timings
    store.submit(make_spec("r"))
    claim(store, "r", "w1")
    store.step([StepItem("r", 1, 0, 7, "a")])
    store.step([StepItem("r", 1, 1, 8, "b", State.COMPLETED, "length")])
    end = Event(store.client.xrange(store.keys.output("r"))[-1][1])
    assert end.state == State.COMPLETED
    assert end.usage == store.record_fields("r", USAGE_FIELDS)
    assert end.usage["n_out"] == "2" and end.usage["prompt_tokens"] == "3"

    class Unread:  # the end's usage must not need the record
        def record_fields(self, *_):
            raise AssertionError("read the record")
    usage, timings = asyncio.run(usage_and_timings(Unread(), "r", end))
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 2)
    assert timings.e2e_ms >= timings.ttft_ms >= timings.queue_ms >= 0


def send_step(store, items):
    """A step sent in halves, as a decode worker's `StepWriter` sends it."""
    return store.send(SyncStore.step.build(store, items))


def test_a_sent_step_applies_and_its_reply_reads_later(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    sent = send_step(store, [StepItem("r", 1, 0, 7, "a"), StepItem("r", 0, 1, 8, "b")])
    assert store.record("r")["state"]  # other commands go on meanwhile, on other connections
    assert sent.result() == [True, False]  # the same answer as step(): kept, stale epoch dropped
    assert tokens(store, "r") == [(0, 7, "a")]
    assert store.end("r", Ending(State.CANCELLED, "cancelled")) == State.CANCELLED
    with pytest.raises(RuntimeError, match="once"):
        sent.result()
    assert send_step(store, [StepItem("r", 1, 1, 9, "c")]).result() == [False]  # ended: dropped


def test_a_sent_step_to_a_redis_without_the_script_runs_it_once(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    store.client.script_flush()
    assert send_step(store, [StepItem("r", 1, 0, 7, "a")]).result() == [True]
    assert tokens(store, "r") == [(0, 7, "a")]


def test_a_sent_step_that_fails_raises_when_read_and_leaves_the_pool_usable(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    sent = send_step(store, [StepItem("r", 1, 3, 1, "x")])  # a gap in the indices: the script errors
    with pytest.raises(Exception, match="gap"):
        sent.result()
    assert send_step(store, [StepItem("r", 1, 0, 7, "a")]).result() == [True]


def test_a_sent_call_of_several_scripts_answers_as_run_at_once_and_reruns_those_redis_had_not_seen(store):
    """`SyncStore.send` sends any call in halves (a colocated worker's first tokens and their
    DECODING moves ride along with its next step): the replies read later answer as `run`
    would, and a script this Redis had not loaded is run again after the rest."""
    from pdq.state.store import RequestStore
    for rid in ("a", "b"):
        store.submit(make_spec(rid))
        claim(store, rid)
    call = RequestStore.step_and_transition.build(store, [StepItem("a", 1, 0, 7, "x"), StepItem("b", 1, 0, 8, "y")],
                                                  [("a", 1, State.DECODING, {"decode_worker": "d:1"})])
    store.client.script_flush()
    sent = store.send(call)
    assert sent.result() == ([True, True], [Moved(deadline_ms=0)])
    with pytest.raises(RuntimeError):
        sent.result()  # read once
    assert tokens(store, "a") == [(0, 7, "x")] and store.record("a")["state"] == "DECODING"
    again = store.send(RequestStore.step_and_transition.build(store, [StepItem("a", 1, 1, 9, "z")],
                                                              [("b", 1, State.DECODING, {})]))
    assert again.result() == ([True], [Moved(deadline_ms=0)]) and tokens(store, "a")[-1] == (1, 9, "z")


def test_consecutive_tokens_of_a_request_go_into_one_entry(store):
    """A worker that writes several tokens of a request at once (stream_interval) makes one
    stream entry of them, each token's text length in bytes alongside; replays are dropped."""
    from gateway.results import Event

    for rid in ("a", "b"):
        store.submit(make_spec(rid, max_tokens=8))
        claim(store, rid)
    assert store.step([StepItem("a", 1, 0, 7, "x")]) == [True]
    assert store.step([StepItem("a", 1, 0, 7, "x"), StepItem("a", 1, 1, 8, "é"), StepItem("a", 1, 2, 9, "yz"),
                       StepItem("b", 1, 0, 5, "q"), StepItem("a", 1, 3, 4, "", State.COMPLETED, "length")]) == [True] * 5
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _, f in store.client.xrange(store.keys.output("a"))]
    assert entries[:3] == [{"i": "0", "t": "7", "x": "x", "l": "1"}, {"i": "1", "t": "8,9", "x": "éyz", "l": "2,2"},
                           {"i": "3", "t": "4", "x": "", "l": "0"}]  # b's token came between
    assert entries[3]["done"] == "COMPLETED" and len(entries) == 4
    event = Event(store.client.xrange(store.keys.output("a"))[1][1])
    assert (event.index, event.token_ids, event.texts) == (1, [8, 9], ["é", "yz"])
    assert store.streamed_tokens("a") == [7, 8, 9, 4] and store.record("a")["n_out"] == "4"
    assert tokens(store, "b") == [(0, 5, "q")]
    # a lone token's entry (stream interval 1) gives its text's length in bytes too, sent or run
    assert send_step(store, [StepItem("b", 1, 1, 6, "日")]).result() == [True]
    assert store.step([StepItem("b", 1, 2, 8, "é"), StepItem("a", 1, 4, 9, "late")]) == [True, False]
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _, f in store.client.xrange(store.keys.output("b"))]
    assert entries[1:] == [{"i": "1", "t": "6", "x": "日", "l": "3"}, {"i": "2", "t": "8", "x": "é", "l": "2"}]


def test_log_probabilities_ride_their_tokens_and_a_replay_keeps_them_aligned(store):
    from gateway.results import Event
    from pdq.state.store import decode_logprobs, encode_logprobs

    rec = [encode_logprobs(-0.25 * i, [(i, -0.25 * i), (99, -3.5)]) for i in range(4)]
    assert decode_logprobs(rec[1]) == (-0.25, [(1, -0.25), (99, -3.5)])
    assert decode_logprobs(encode_logprobs(-1.0, [])) == (-1.0, [])
    store.submit(make_spec("lp", max_tokens=8))
    claim(store, "lp")
    assert store.step([StepItem("lp", 1, 0, 10, "a", logprobs=rec[0])]) == [True]
    # a replay of token 0 with tokens 1..2: only the new tokens, with their own records
    assert store.step([StepItem("lp", 1, i, 10 + i, "abc"[i], logprobs=rec[i]) for i in range(3)]) == [True] * 3
    assert store.step([StepItem("lp", 1, 3, 13, "d")]) == [True]  # no logprobs: no field
    events = [Event(f) for _, f in store.client.xrange(store.keys.output("lp"))]
    assert [(e.index, e.token_ids) for e in events] == [(0, [10]), (1, [11, 12]), (3, [13])]
    assert [[(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in e.logprobs]
            for e in events] == [[(10, 0.0, [(0, 0.0), (99, -3.5)])],
                                 [(11, -0.25, [(1, -0.25), (99, -3.5)]), (12, -0.5, [(2, -0.5), (99, -3.5)])], []]


def test_a_step_answers_every_item_whatever_runs_it_was_sent_in(store):
    """Items go to Redis as runs (a request's consecutive tokens, then maybe its end); the
    answer is still one per item: a stale run drops all its items, a replayed run writes nothing."""
    for rid in ("a", "b"):
        store.submit(make_spec(rid, max_tokens=8))
        claim(store, rid)
    items = [StepItem("a", 1, 0, 7, "x"), StepItem("a", 1, 1, 8, "y"), StepItem("b", 0, 0, 5, "q"),
             StepItem("b", 0, 1, 6, "r"), StepItem("b", 1, 0, 5, "q")]
    assert store.step(items) == [True, True, False, False, True]
    assert store.step(items[:2]) == [True, True]  # all replayed: nothing new
    assert store.step([StepItem("a", 1, final_state=State.CANCELLED, finish_reason="cancelled"),
                       StepItem("b", 1, 1, 6, "r")]) == [True, True]
    assert store.streamed_tokens("a") == [7, 8] and store.record("a")["state"] == "CANCELLED"
    assert store.streamed_tokens("b") == [5, 6] and store.record("b")["n_out"] == "2"


def test_token_gap_is_an_error(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    with pytest.raises(Exception, match="gap"):
        store.step([StepItem("r", 1, 3, 1, "x")])


def test_cancel_a_queued_request_frees_its_queue_entry(store):
    store.submit(make_spec("r", deadline_ms=10**13))
    pubsub = store.client.pubsub()
    pubsub.subscribe(store.keys.cancel_channel)
    assert store.end("r", Ending(State.CANCELLED, "cancelled", "by client")) == State.CANCELLED
    assert queued(store) == []
    assert store.client.zcard(store.keys.deadlines) == 0
    assert claim(store, "r") == 0
    assert store.end("nope", Ending(State.CANCELLED, "cancelled")) is None
    msgs = [m for m in iter(lambda: pubsub.get_message(timeout=1), None) if m["type"] == "message"]
    assert [m["data"] for m in msgs] == [b"r"]


def test_a_request_its_worker_ends_in_a_step_is_not_announced_on_the_cancel_channel(store):
    """The cancel channel tells workers to drop requests that ended elsewhere; a worker that ends
    its own request in a step holds the only attempt, so nobody is told (every worker's listener
    would wake for each finished request)."""
    for rid in ("done", "gone"):
        store.submit(make_spec(rid))
        claim(store, rid)
    pubsub = store.client.pubsub()
    pubsub.subscribe(store.keys.cancel_channel)
    assert store.step([StepItem("done", 1, 0, 7, "a", State.COMPLETED, "length")]) == [True]
    assert store.end("gone", Ending(State.CANCELLED, "cancelled")) == State.CANCELLED
    msgs = [m for m in iter(lambda: pubsub.get_message(timeout=1), None) if m["type"] == "message"]
    assert [m["data"] for m in msgs] == [b"gone"]
    assert store.record("done")["state"] == "COMPLETED"


def test_requeue_keeps_the_place_under_a_new_epoch_then_fails_when_attempts_are_spent(store):
    store.submit(make_spec("first"))
    store.submit(make_spec("second"))
    assert claim(store, "first") == 1
    assert store.requeue("first", 1, "worker died", max_attempts=2) == "QUEUED"
    assert store.requeue("first", 1, "again", max_attempts=2) is None  # already requeued: stale
    assert store.step([StepItem("first", 1, 0, 7, "a")]) == [False]  # the old attempt cannot write
    assert queued(store) == ["first", "second"]
    assert claim(store, "first") == 3
    assert store.requeue("first", 3, "worker died", max_attempts=2) == "FAILED"
    assert store.record("first")["error"] == "worker died"


def test_transition_checks_epoch(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    assert store.transition("r", 2, State.DECODING) is False
    assert store.transition("r", 1, State.DECODING, decode_worker="d1") == Moved(deadline_ms=0)
    rec = store.record("r")
    assert rec["state"] == "DECODING" and rec["decode_worker"] == "d1"


def test_first_tokens_and_decoding_moves_go_in_one_round_trip_in_order(store):
    for rid in ("a", "b", "c"):
        store.submit(make_spec(rid))
        claim(store, rid)
    store.transition("a", 1, State.PREFILLING)
    store.transition("b", 1, State.PREFILLING)
    store.end("c", Ending(State.CANCELLED, "cancelled"))  # ended elsewhere: its token is dropped, it does not move
    kept, moved = store.step_and_transition(
        [StepItem("a", 1, 0, 7, "x"), StepItem("b", 1, 0, 8, "y"), StepItem("c", 1, 0, 9, "z")],
        [("a", 1, State.DECODING, {"decode_worker": "d:1"}), ("c", 1, State.DECODING, {"decode_worker": "d:1"})])
    assert kept == [True, True, False] and moved == [Moved(deadline_ms=0), False]
    assert store.record("a")["state"] == "DECODING" and store.record("a")["decode_worker"] == "d:1"
    assert store.record("b")["state"] == "PREFILLING"  # not asked to move
    assert tokens(store, "a") == [(0, 7, "x")] and tokens(store, "c") == []


def test_step_and_transition_on_a_redis_without_the_scripts_runs_each_once(store):
    store.submit(make_spec("r"))
    claim(store, "r")
    store.client.script_flush()
    kept, moved = store.step_and_transition([StepItem("r", 1, 0, 7, "x")],
                                            [("r", 1, State.DECODING, {"decode_worker": "d:1"})])
    assert (kept, moved) == ([True], [Moved(deadline_ms=0)])
    assert tokens(store, "r") == [(0, 7, "x")] and store.record("r")["state"] == "DECODING"


def test_a_timeout_read_from_a_stale_deadline_does_not_end_a_request_whose_deadline_moved(store):
    """A worker (or the gateway) decides a timeout from its copy of the deadline; an operator may
    move it between that read and the write. The end is applied only if the record's deadline
    has passed: otherwise the request goes on, whether it ends through END or through STEP."""
    from pdq.state.store import now_ms

    store.submit(make_spec("r", deadline_ms=now_ms() - 10))
    epoch = claim(store, "r")
    store.set_deadline("r", now_ms() + 60_000)  # moved after the worker read the old one
    assert store.end("r", Ending.timed_out("during prefill"), epoch=epoch) == State.PREFILLING
    assert store.step([StepItem("r", epoch, 0, 7, "a"),
                       StepItem("r", epoch, final_state=State.TIMED_OUT, finish_reason="timeout")]) == [True, True]
    assert store.record("r")["state"] == "PREFILLING" and tokens(store, "r") == [(0, 7, "a")]  # the token, not the end
    assert store.states(["r", "nobody"]) == [State.PREFILLING, None]
    store.set_deadline("r", now_ms() - 1)  # passed now
    assert store.end("r", Ending.timed_out("during prefill"), epoch=epoch) == State.TIMED_OUT


async def test_every_read_answers_the_same_through_the_async_and_the_sync_store(store, redis_server, prefix):
    import redis.asyncio as aioredis
    from pdq.state.store import AsyncStore, TenantPolicy
    store.submit(make_spec("r1", deadline_ms=9_000_000_000_000), "key-1")
    store.submit(make_spec("r2", tenant="globex", prompt=(4, 5), deadline_ms=8_000_000_000_000))
    store.set_tenant_policy("acme", TenantPolicy(weight=2.0))
    store.pause(tenant="globex")
    epoch = claim(store, "r1")
    store.step([StepItem("r1", epoch, 0, 7, "a"), StepItem("r1", epoch, 1, 8, "b")])
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        other = AsyncStore(client, prefix, result_ttl_s=60)
        reads = [
            ("next_deadline_ms", ()), ("load", ()), ("tenant_policy", ("acme",)), ("tenants", ()),
            ("depth", (["interactive"],)), ("paused", ()), ("records", (["r1", "nope"],)),
            ("prompts", (["r2", "nope"],)), ("states", (["r1", "r2", "nope"],)), ("deadlines", (["r1", "nope"],)),
            ("record_fields", ("r1", ("state", "tenant", "missing"))), ("streamed_tokens", ("r1",)),
            ("lookup_idempotent", ("acme", "key-1")), ("list_requests", ()), ("record", ("r2",)),
        ]
        for name, args in reads:
            assert await getattr(other, name)(*args) == getattr(store, name)(*args), name
    finally:
        await client.aclose()
    assert store.next_deadline_ms() == 8_000_000_000_000
    assert store.tenant_policy("acme").weight == 2.0 and store.tenants() == ["acme"]
    assert store.depth(["interactive"]) == [("interactive", "globex", 1, 2 + 4)]
    assert store.paused() == ([], ["globex"])
    assert store.states(["r1", "r2", "nope"]) == [State.PREFILLING, State.QUEUED, None]
    assert store.streamed_tokens("r1") == [7, 8]
    assert store.lookup_idempotent("acme", "key-1") == "r1" and store.lookup_idempotent("acme", "other") is None
    assert store.prompts(["r2", "nope"]) == [(4, 5), ()]
    assert store.record_fields("r1", ("tenant", "missing")) == {"tenant": "acme"}
    assert store.pause(tenant="globex", paused=False) == 1 and store.paused() == ([], [])
    assert store.policy_and_seq("acme")[0].weight == 2.0 and store.announce("r2") == 0  # nobody listens here


def test_joined_calls_answer_as_each_alone_in_one_round_trip_even_with_scripts_redis_had_not_seen(store):
    """The dispatcher reads a round's queue snapshot, the registry and the queue's counters in
    one pipeline (`calls.joined`); each part answers what it answers alone, and a script this
    Redis had not loaded is run again alone after the rest."""
    from pdq.state.calls import joined, mapped
    from pdq.state.registry import ROLES, live_call
    from pdq.state.store import RequestStore
    store.submit(make_spec("r1"))
    store.submit(make_spec("r2", tenant="globex", prompt=(4, 5)))
    store.heartbeat("w1", "decode", 10_000, {"address": "127.0.0.1:1", "free_slots": 3, "capacity": 4})
    alone = (store.snapshot(["interactive"], 8, 8), store.run(live_call(store, ROLES, 5.0)), store.load())
    store.client.script_flush()
    call = joined(joined(RequestStore.snapshot.build(store, ["interactive"], 8, 8), live_call(store, ROLES, 5.0)),
                  RequestStore.load.build(store))
    assert len(call.parts) == 3
    (snapshot, live), load = store.run(call)
    assert (snapshot, live, load) == alone
    assert [b.tenant for b in snapshot["interactive"]] == ["acme", "globex"] and load["n"] == 2
    assert [(w.worker_id, w.free_slots, w.capacity) for w in live["decode"]] == [("w1", 3, 4)]
    assert store.run(mapped(RequestStore.load.build(store), lambda got: got["n"])) == 2
