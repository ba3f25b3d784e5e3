"""The workers' model loops under Redis trouble and poisoned requests: a real DecodeLoop or
PrefillLoop in this process, over the built-in tiny model and a real Redis server.

A request is dispatched to a loop as the scheduler and a prefill worker would: submitted and
claimed with the store's scripts, its prompt prefilled into a KV slot of the loop's runner, its
first token written, and the hand-off (`Arrived`) given to the loop.
"""

import logging
import signal
import threading
import time

import pytest

from decode_worker.kv_receive import Arrived
from decode_worker.loop import DecodeLoop
from pdq.bench.step_cost import hand_over
from pdq.observability import liveness
from pdq.state import redisconn
from pdq.state.cancel_listener import CancelListener
from pdq.engine.runner import ModelRunner, PrefillItem
from pdq.state.keys import Keys
from pdq.model.loader import eos_token_ids, resolve_model
from pdq.model.tokenizer import load_tokenizer
from pdq.ops.redis_server import RedisServer
from pdq.state.request import State
from pdq.state.store import SyncStore, now_ms
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import internal_pb2 as pb
from pdq.engine.worker import ModelThread
from prefill_worker.loop import Job, PrefillLoop

PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 8, 120, 64, 11, 2], [200, 1, 33]]


@pytest.fixture(scope="module")
def model():
    path = resolve_model("builtin:tiny")
    return str(path), load_tokenizer(path), eos_token_ids(path)


@pytest.fixture
def fatal():
    """What `liveness.fatal` was asked (the reasons), instead of taking this process down."""
    reasons: list[str] = []
    called = threading.Event()

    def record(reason: str) -> None:
        reasons.append(reason)
        called.set()

    liveness.on_fatal(record)
    yield reasons, called
    liveness.on_fatal(lambda reason: None)


class Rig:
    """A decode loop (not started) over its own runner, with the store and listener a worker uses."""

    def __init__(self, url: str, prefix: str, model, outage_s: float = 30.0, max_seq_len: int = 512,
                 kv_budget_tokens: int = 0):
        path, self.tokenizer, self.eos = model
        self.runner = ModelRunner.from_pretrained(path, kv_budget_tokens=kv_budget_tokens or 6 * max_seq_len,
                                                  max_seq_len=max_seq_len)
        self.client = redisconn.connect(url, outage_s=outage_s)
        self.store = SyncStore(self.client, prefix, result_ttl_s=600)
        self.cancels = CancelListener(url, Keys(prefix), outage_s)
        self.left: list[str] = []
        self.loop = DecodeLoop(self.runner, self.store, self.cancels, self.tokenizer, self.eos, "here", self.left.extend)

    def dispatch(self, rid: str, prompt: list[int], max_tokens: int, deadline_ms: int = 0, tier: str = "interactive",
                 tenant: str = "acme", **sampling) -> Arrived:
        """Queues, claims and prefills a request; -> its hand-off (give it to the loop)."""
        spec = pb.RequestSpec(request_id=rid, tenant=tenant, tier=tier, prompt_token_ids=prompt,
                              sampling=gen_pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
                              arrival_ms=now_ms(), deadline_ms=deadline_ms)
        return hand_over(self.store, self.runner, spec, "decode-here", "prefill-here")

    def record(self, rid: str) -> dict:
        return {k: v for k, v in self.store.record(rid).items() if k != "spec"}

    def stream(self, rid: str) -> list[tuple[int, int]]:
        """(index, token id) of every token in the request's output stream, in stream order."""
        out = []
        for _, entry in self.client.xrange(self.store.keys.output(rid)):
            if b"i" in entry:
                first = int(entry[b"i"])
                out += [(first + k, int(t)) for k, t in enumerate(entry[b"t"].split(b","))]
        return out

    def close(self) -> None:
        self.cancels.close()
        self.client.close()


@pytest.fixture
def rig(redis_server, prefix, model):
    r = Rig(redis_server.url, prefix, model)
    yield r
    r.close()


def wait_for(what: str, check, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.01)
    return got


def run_to_completion(rig: Rig, rids: list[str], during=None) -> None:
    """Runs the loop in a model thread until the requests completed (`during()` meanwhile)."""
    rig.loop.start(ModelThread("test-decode"))
    try:
        if during is not None:
            during()
        wait_for("the requests to complete", lambda: all(rig.record(r)["state"] == "COMPLETED" for r in rids))
    finally:
        rig.loop.stop()


def test_a_decode_loop_whose_redis_connections_are_dropped_mid_generation_keeps_its_sequences(rig, redis_client):
    """Connections killed under the loop (CLIENT KILL TYPE normal, Redis up) break the step in
    flight and the idle pooled ones: every step is applied again through the riding client, so
    each stream is whole (no gap, no repeat), equal to a fault-free run, in its first attempt."""
    n = 150
    for i, prompt in enumerate(PROMPTS):
        rig.loop.add(rig.dispatch(f"clean-{i}", prompt, n))
    run_to_completion(rig, [f"clean-{i}" for i in range(len(PROMPTS))])
    rig.loop = DecodeLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, "here", rig.left.extend)
    rig.loop.step_delay_s = 0.005  # so that the kills land mid-generation
    rids = [f"kill-{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(rids, PROMPTS):
        rig.loop.add(rig.dispatch(rid, prompt, n))
    kills = []

    def kill_connections() -> None:
        wait_for("tokens from the loop", lambda: all(int(rig.record(r)["n_out"]) >= 3 for r in rids))
        while len(kills) < 30 and not all(rig.record(r)["state"] == "COMPLETED" for r in rids):
            kills.append(redis_client.client_kill_filter(_type="normal", skipme=True))
            time.sleep(0.02)

    run_to_completion(rig, rids, kill_connections)
    assert sum(kills) >= 5  # the loop's connections were dropped, repeatedly
    for i, rid in enumerate(rids):
        rec, clean = rig.record(rid), rig.stream(f"clean-{i}")
        assert (rec["state"], rec["attempts"], rec["epoch"], rec["n_out"]) == ("COMPLETED", "1", "1", str(n))
        assert rig.stream(rid) == clean and [i for i, _ in clean] == list(range(n))


def test_a_decode_loop_rides_a_redis_crash_that_loses_a_steps_reply_and_its_restart(prefix, model, tmp_path, caplog):
    """Redis frozen with a step sent and unanswered, then killed (its reply is lost with the
    connection) and restarted from its AOF: the loop applies the step again through the riding
    client, and each stream is whole and equal to a fault-free run, in its first attempt."""
    caplog.set_level(logging.WARNING, logger="pdq.decode")
    server = RedisServer(directory=str(tmp_path), durable=True).start()
    rig = Rig(server.url, prefix, model)
    try:
        n = 120
        rids = [f"r{i}" for i in range(len(PROMPTS))]
        for i, prompt in enumerate(PROMPTS):
            rig.loop.add(rig.dispatch(f"clean-{i}", prompt, n))
        run_to_completion(rig, [f"clean-{i}" for i in range(len(PROMPTS))])
        rig.loop = DecodeLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, "here", rig.left.extend)
        for rid, prompt in zip(rids, PROMPTS):
            rig.loop.add(rig.dispatch(rid, prompt, n))

        def crash_and_restart() -> None:
            wait_for("tokens from the loop", lambda: all(int(rig.record(r)["n_out"]) >= 3 for r in rids))
            rig.loop.step_delay_s = 0.05  # a step's reply stays unread for a whole (slowed) forward pass: seen below
            server.process.send_signal(signal.SIGSTOP)  # the next step is sent and never answered
            wait_for("a step waiting for its reply", lambda: rig.loop.writes.sent is not None and rig.loop.writes.sent[0] is not None)
            time.sleep(0.3)  # the loop is blocked reading that reply (it reads it before the next send)
            server.process.send_signal(signal.SIGKILL)
            server.process.wait()
            server.start()  # same port, same AOF
            rig.loop.step_delay_s = 0.0

        run_to_completion(rig, rids, crash_and_restart)
        assert any("reply of a decode step lost" in r.getMessage() for r in caplog.records)
        for i, rid in enumerate(rids):
            rec, clean = rig.record(rid), rig.stream(f"clean-{i}")
            assert (rec["state"], rec["attempts"], rec["epoch"], rec["n_out"]) == ("COMPLETED", "1", "1", str(n))
            assert rig.stream(rid) == clean and [i for i, _ in clean] == list(range(n))
    finally:
        rig.close()
        server.stop()


def test_a_redis_outage_longer_than_the_window_takes_the_decode_loop_down_through_fatal(prefix, model, fatal, tmp_path):
    reasons, called = fatal
    server = RedisServer(directory=str(tmp_path)).start()
    rig = Rig(server.url, prefix, model, outage_s=0.5)
    try:
        rig.loop.step_delay_s = 0.01
        rig.loop.add(rig.dispatch("r", PROMPTS[0], 400))
        rig.loop.start(ModelThread("test-decode"))
        wait_for("tokens from the loop", lambda: int(rig.record("r")["n_out"]) >= 3)
        server.stop()  # from this (the spawning) thread; it stays down
        assert called.wait(60), "the loop did not call liveness.fatal"
        assert "decode-loop" in reasons[0] and "Error" in reasons[0]
        wait_for("the loop to end", lambda: not rig.loop.alive)
    finally:
        rig.loop.stop()
        rig.close()
        server.stop()


def test_a_decode_step_with_one_poisoned_row_fails_only_that_request(rig):
    rids = ["a", "poisoned", "b"]
    for rid, prompt in zip(rids, PROMPTS):
        rig.loop._arrive(rig.dispatch(rid, prompt, 6, temperature=0.8, seed=7))
    rig.loop._step()  # the core admits all three and runs their first step here
    assert sorted(rig.loop.running) == sorted(rids)
    object.__setattr__(rig.loop.running["poisoned"].params, "temperature", "hot")  # sampling raises for it
    while rig.loop.running:
        rig.loop._step()
    rig.loop.settle()
    poisoned = rig.record("poisoned")
    assert poisoned["state"] == "FAILED" and "sampling failed" in poisoned["error"]
    assert [rig.record(r)["state"] for r in ("a", "b")] == ["COMPLETED", "COMPLETED"]
    assert [len(rig.stream(r)) for r in ("a", "b")] == [6, 6]
    assert sorted(rig.left) == sorted(rids) and rig.runner.free_tokens == rig.runner.capacity_tokens


def test_tokens_that_leave_a_requests_constraint_fail_it_alone_at_the_decode_worker(rig):
    """A hand-off whose tokens so far do not replay into its grammar is the request's own fault:
    it FAILS saying why (not retried elsewhere as a worker's fault), its KV freed; the rest run."""
    bad = rig.dispatch("bad", PROMPTS[0], 4, regex="[0-9]{3}")  # its first token was picked unconstrained
    assert not rig.tokenizer.decode(list(bad.header.generated_token_ids)).isdigit()
    rig.loop._arrive(bad)
    rig.loop._arrive(rig.dispatch("fine", PROMPTS[1], 4))
    failed = rig.record("bad")
    assert failed["state"] == "FAILED" and "structured output" in failed["error"]
    assert rig.left == ["bad"] and [s.rid for s in rig.loop.waiting] == ["fine"]
    while rig.loop.busy:
        rig.loop._step()
    rig.loop.settle()
    assert rig.record("fine")["state"] == "COMPLETED" and rig.runner.free_tokens == rig.runner.capacity_tokens


def test_a_prefill_pass_with_one_poisoned_row_fails_only_that_request(rig):
    prefill = PrefillLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, 256, 64)
    outcomes = {}
    jobs = []
    for rid, prompt in zip(["a", "poisoned", "b"], PROMPTS):
        spec = pb.RequestSpec(request_id=rid, tenant="acme", tier="interactive", prompt_token_ids=prompt,
                              sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.8, seed=2**64 - 1))
        rig.store.submit(spec)
        (claimed,) = rig.store.claim([(rid, "decode-there")], "prefill-here")
        item = pb.PrefillItem(spec=spec, epoch=claimed.epoch, decode_address="elsewhere:1")
        jobs.append(Job(item, lambda outcome, rid=rid: outcomes.__setitem__(rid, outcome)))
    live, plan = prefill.plan(jobs, 256)
    assert len(plan.prefill) == 3
    object.__setattr__(jobs[1].params, "temperature", "hot")
    logits = rig.runner.step(*plan.items())
    assert prefill.finish(live, plan, logits, time.perf_counter()) == []
    assert {rid: o.kind for rid, o in outcomes.items()} == {"a": "handoff", "poisoned": "dropped", "b": "handoff"}
    poisoned = rig.record("poisoned")
    assert poisoned["state"] == "FAILED" and "sampling failed" in poisoned["error"]
    assert [rig.record(r)["state"] for r in ("a", "b")] == ["TRANSFERRING", "TRANSFERRING"]
    assert rig.runner.free_tokens == rig.runner.capacity_tokens


def test_prompts_sharing_blocks_with_one_being_prefilled_wait_a_pass_and_skip_them(rig):
    """n choices of one prompt (or a burst sharing a system prompt) arriving together: the first
    pass computes the shared blocks once; the others start past them the pass after."""
    prefill = PrefillLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, 1024, 512)
    system = [(7 * i) % 250 + 3 for i in range(100)]  # 6 full blocks of 16, then 4 tokens
    outcomes, jobs = {}, []
    for rid, tail in [("c0", [1]), ("c1", [1]), ("other", []), ("c2", [2, 2])]:
        prompt = system + tail if rid != "other" else PROMPTS[1]
        spec = pb.RequestSpec(request_id=rid, tenant="acme", tier="interactive", prompt_token_ids=prompt,
                              sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0))
        rig.store.submit(spec)
        (claimed,) = rig.store.claim([(rid, "decode-there")], "prefill-here")
        jobs.append(Job(pb.PrefillItem(spec=spec, epoch=claimed.epoch, decode_address="elsewhere:1"),
                        lambda outcome, rid=rid: outcomes.__setitem__(rid, outcome)))
    live, plan = prefill.plan(jobs, 1024)
    assert [c.seq.seq_id[1] for c in plan.prefill] == ["c0", "other"]  # c1 and c2 wait for c0's blocks
    live = prefill.finish(live, plan, rig.runner.step(*plan.items()), time.perf_counter())
    live, plan = prefill.plan(live, 1024)
    assert [(c.seq.seq_id[1], c.start, c.length) for c in plan.prefill] == [("c1", 96, 5), ("c2", 96, 6)]
    assert prefill.finish(live, plan, rig.runner.step(*plan.items()), time.perf_counter()) == []
    assert {o.kind for o in outcomes.values()} == {"handoff"} and len(outcomes) == 4


def test_a_request_with_a_seed_past_2_63_is_prefilled_with_the_rest(rig):
    """A seed >= 2**63 (a valid uint64) made the whole pass raise; now each seed samples."""
    prefill = PrefillLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, 256, 64)
    outcomes = {}
    jobs = []
    for rid, seed in [("low", 1), ("high", 2**63), ("top", 2**64 - 1)]:
        spec = pb.RequestSpec(request_id=rid, tenant="acme", tier="interactive", prompt_token_ids=PROMPTS[0],
                              sampling=gen_pb.SamplingParams(max_tokens=4, temperature=1.0, seed=seed))
        rig.store.submit(spec)
        (claimed,) = rig.store.claim([(rid, "decode-there")], "prefill-here")
        jobs.append(Job(pb.PrefillItem(spec=spec, epoch=claimed.epoch, decode_address="elsewhere:1"),
                        lambda outcome, rid=rid: outcomes.__setitem__(rid, outcome)))
    assert prefill._pass(jobs) == []
    assert {rid: o.kind for rid, o in outcomes.items()} == {"low": "handoff", "high": "handoff", "top": "handoff"}


def test_the_decode_loop_takes_a_deadline_moved_while_its_listener_was_away(redis_server, redis_client, rig):
    """A deadline moved while the listener could not subscribe (its message lost) reaches the
    running sequence once the listener is back: the loop reads the records of what it holds."""
    user = f"u{rig.store.keys.prefix}"
    redis_client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"])
    rig.cancels.close()
    rig.cancels = CancelListener(redis_server.url.replace("redis://", f"redis://{user}:pw@"), rig.store.keys)
    rig.loop.cancels = rig.cancels
    rig.loop.step_delay_s = 0.02
    old = now_ms() + 600_000
    rig.loop.add(rig.dispatch("r", PROMPTS[0], 400, deadline_ms=old))
    rig.loop.start(ModelThread("test-decode"))
    try:
        wait_for("the sequence to run", lambda: "r" in rig.loop.running)
        redis_client.acl_setuser(user, enabled=True, commands=["-subscribe"])  # it cannot subscribe again for now
        assert redis_client.client_kill_filter(_type="pubsub", user=user) == 1
        wait_for("a failed resubscribe", lambda: rig.cancels.liveness.failing >= 1)
        new = now_ms() + 900_000
        assert rig.store.set_deadline("r", new) == State.DECODING  # published to nobody
        redis_client.acl_setuser(user, enabled=True, commands=["+subscribe"])
        wait_for("the listener to be back", lambda: rig.cancels.gaps == 1)
        wait_for("the moved deadline to reach the sequence",
                 lambda: getattr(rig.loop.running.get("r"), "deadline_ms", None) == new)
    finally:
        rig.loop.stop()
        redis_client.acl_deluser(user)


def test_a_deadline_moved_while_the_request_was_on_its_way_to_the_decode_worker_is_the_one_it_keeps(rig):
    """The hand-off carries the spec as it was submitted; an operator's move meanwhile may have
    been published before this worker held the request (or while its listener reconnected). The
    move to DECODING answers the record's deadline, and that one is enforced."""
    old = now_ms() + 60_000
    arrived = rig.dispatch("moved", PROMPTS[1], 8, deadline_ms=old)
    new = now_ms() + 900_000
    assert rig.store.set_deadline("moved", new) == State.TRANSFERRING  # before the hand-off arrives
    rig.cancels.deadlines.clear()  # as if the notice was lost: only the record knows
    rig.loop.step_delay_s = 0.05
    rig.loop.add(arrived)
    rig.loop.start(ModelThread("test-decode"))
    try:
        wait_for("the sequence to take the record's deadline",
                 lambda: getattr(rig.loop.running.get("moved") or next(iter(rig.loop.waiting), None),
                                 "deadline_ms", None) == new)
        wait_for("the request to complete", lambda: rig.record("moved")["state"] == "COMPLETED")
    finally:
        rig.loop.stop()


def test_workers_reread_a_passed_deadline_from_the_record_before_they_time_a_request_out(rig, redis_client):
    """A notice of a moved deadline can be lost (a listener reconnecting, a request not yet held).
    Before a worker times a request out at the deadline it knows, it reads the record's: one
    that an operator moved later keeps the request running, in prefill and in decode."""
    soon = now_ms() + 300
    later = now_ms() + 900_000
    # prefill: a job whose spec says `soon`, the record `later`
    prefill = PrefillLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, 256, 64)
    spec = pb.RequestSpec(request_id="p", tenant="acme", tier="interactive", prompt_token_ids=PROMPTS[0],
                          sampling=gen_pb.SamplingParams(max_tokens=4), deadline_ms=soon)
    rig.store.submit(spec)
    (claimed,) = rig.store.claim([("p", "decode-there")], "prefill-here")
    redis_client.hset(rig.store.keys.request("p"), "deadline_ms", later)  # moved, and no notice sent
    outcomes = {}
    job = Job(pb.PrefillItem(spec=spec, epoch=claimed.epoch, decode_address="elsewhere:1"),
              lambda outcome: outcomes.__setitem__("p", outcome))
    wait_for("the spec's deadline to pass", lambda: now_ms() > soon)
    live, plan = prefill.plan([job], 256)
    assert live == [job] and len(plan.prefill) == 1 and rig.record("p")["state"] == "PREFILLING"
    prefill.core.finish(job.key, "test over")  # its blocks freed
    # decode: a running sequence whose known deadline passes while the record says `later`
    arrived = rig.dispatch("d", PROMPTS[1], 40, deadline_ms=now_ms() + 300)
    rig.loop.step_delay_s = 0.02
    rig.loop.add(arrived)
    rig.loop.start(ModelThread("test-decode"))
    try:
        wait_for("the sequence to run", lambda: "d" in rig.loop.running)
        redis_client.hset(rig.store.keys.request("d"), "deadline_ms", later)
        rig.loop.running["d"].deadline_ms = now_ms() - 1  # the deadline it knows has passed
        wait_for("the request to complete", lambda: rig.record("d")["state"] == "COMPLETED")
    finally:
        rig.loop.stop()


def test_when_kv_blocks_run_out_mid_decode_the_least_important_sequence_is_preempted_not_the_step(
        redis_server, prefix, model, caplog):
    """Sequences take blocks as they grow. In a pool too small for all of them, the batch-tier one
    is given back by recompute (requeued as preempted, its streamed tokens kept, no attempt
    counted) when blocks run out; the step never fails and the others complete whole."""
    caplog.set_level(logging.INFO, logger="pdq.decode")
    rig = Rig(redis_server.url, prefix, model, max_seq_len=128, kv_budget_tokens=256)  # 16 blocks of 16
    rig.loop = DecodeLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, "here", rig.left.extend,
                          tiers=("interactive", "batch"))
    try:
        n = 100  # each sequence ends holding 7 blocks: the three need 21
        rig.loop.add(rig.dispatch("batch", PROMPTS[0], n, tier="batch"))
        rig.loop.add(rig.dispatch("a", PROMPTS[1], n))
        rig.loop.add(rig.dispatch("b", PROMPTS[2], n, tenant="globex"))
        run_to_completion(rig, ["a", "b"])
        assert not any("decode step failed" in r.getMessage() for r in caplog.records)
        for rid in ("a", "b"):
            assert [i for i, _ in rig.stream(rid)] == list(range(n)) and rig.record(rid)["attempts"] == "1"
        victim = rig.record("batch")
        assert victim["state"] == "QUEUED" and "|preempted|QUEUED|KV blocks ran out" in victim["requeued"]
        assert victim["attempts"] == "1" and victim.get("failures", "0") == "0" and victim.get("lost", "0") == "0"
        streamed = [i for i, _ in rig.stream("batch")]
        assert 0 < len(streamed) < n and streamed == list(range(len(streamed)))  # kept, in order, to resume from
        assert any("KV blocks ran out" in r.getMessage() for r in caplog.records)
    finally:
        rig.close()


def test_a_static_batch_keeps_finished_seats_and_gives_them_up_when_its_last_running_sequence_is_preempted(rig):
    """Request-level batches in the decode worker's core: a finished sequence keeps its seat (its
    row computed and thrown away) while the batch runs; when the batch's last running sequence
    leaves by preemption instead of finishing, the kept seats are given up too (their holds
    told, their blocks freed): nothing is left seated."""
    from decode_worker.loop import PreemptAsk
    from pdq.engine.batching import Strategy

    rig.loop.strategy = rig.loop.core.strategy = Strategy("static", batch_size=2)
    rig.loop._arrive(rig.dispatch("short", PROMPTS[0], 3))
    rig.loop._arrive(rig.dispatch("long", PROMPTS[1], 40))
    rig.loop._step()
    assert sorted(rig.loop.running) == ["long", "short"]  # a full batch of 2
    while rig.record("short")["state"] != "COMPLETED":
        rig.loop._step()
        rig.loop.settle()
    assert rig.loop.running["short"].done and rig.left == []  # its seat is kept
    padded = rig.loop.core.padded
    rig.loop._step()
    assert rig.loop.core.padded == padded + 1  # and its row computed, for nothing
    ask = PreemptAsk(("interactive",), "a better tier arrived")
    rig.loop._preempt(ask)
    assert ask.done.result() == "long" and rig.record("long")["state"] == "QUEUED"
    rig.loop._step()  # the batch is over: the seat goes
    assert sorted(rig.left) == ["long", "short"] and not rig.loop.busy
    assert rig.runner.free_tokens == rig.runner.capacity_tokens


def test_a_prompt_with_one_token_left_past_its_cached_prefix_is_prefilled_as_a_one_token_row(rig):
    """A prompt whose every full block the prefix cache holds has one token left to run: the core
    plans it as a one-token row, which the prefill loop runs and hands off like any chunk."""
    prefill = PrefillLoop(rig.runner, rig.store, rig.cancels, rig.tokenizer, rig.eos, 256, 64)
    prompt = [(11 * i) % 250 + 3 for i in range(rig.runner.block_size + 1)]  # one full block, then one token
    outcomes = {}
    for rid in ("first", "again"):
        spec = pb.RequestSpec(request_id=rid, tenant="acme", tier="interactive", prompt_token_ids=prompt,
                              sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0))
        rig.store.submit(spec)
        (claimed,) = rig.store.claim([(rid, "decode-there")], "prefill-here")
        job = Job(pb.PrefillItem(spec=spec, epoch=claimed.epoch, decode_address="elsewhere:1"),
                  lambda outcome, rid=rid: outcomes.__setitem__(rid, outcome))
        live, plan = prefill.plan([job], 256)
        logits = rig.runner.step(*plan.items())
        assert prefill.finish(live, plan, logits, time.perf_counter()) == []
        if rid == "again":
            assert not plan.prefill and [s.seq_id for s in plan.decode] == [job.key]  # its last token alone
    assert {rid: o.kind for rid, o in outcomes.items()} == {"first": "handoff", "again": "handoff"}
    assert outcomes["again"].generated == outcomes["first"].generated  # the same first token (greedy)
    assert rig.runner.free_tokens == rig.runner.capacity_tokens


def test_a_hand_off_whose_tokens_do_not_match_its_kv_is_given_back_and_the_rest_decode(rig):
    """A header claiming more tokens than its K/V holds would make a step fail for every sequence
    in it: the hand-off is refused on arrival (its slot freed, the request requeued for another
    attempt), and the batch decodes on."""
    fine = rig.dispatch("fine", PROMPTS[0], 5)
    odd = rig.dispatch("odd", PROMPTS[1], 5)
    odd.header.generated_token_ids.append(9)  # one token more than its K/V covers
    rig.loop._arrive(odd)
    rig.loop._arrive(fine)
    assert rig.left == ["odd"] and rig.record("odd")["state"] == "QUEUED"
    assert "hand-off holds K/V for 7 positions" in rig.record("odd")["error"]
    while rig.loop.busy:
        rig.loop._step()
    rig.loop.settle()
    assert rig.record("fine")["state"] == "COMPLETED" and len(rig.stream("fine")) == 5
    assert rig.runner.free_tokens == rig.runner.capacity_tokens


def test_first_tokens_riding_along_are_applied_before_the_next_token_and_a_refused_one_takes_its_sequence_away(rig):
    """A colocated worker hands its prompts to its decode side before their first tokens and
    DECODING moves are applied: those ride along with the decode loop's next step
    (`DecodeLoop.ride_along`), whose reply is read after the next forward pass. Redis applies
    them before that step's tokens (each stream's indices follow on), and one it refuses (here a
    stale attempt: the request was requeued meanwhile) takes its sequence off the decode side,
    blocks freed, nothing of it written."""
    from decode_worker.writes import RideAlong
    from pdq.state.store import Moved, StepItem

    handed, items, moves = [], [], []
    for rid, prompt in (("kept", PROMPTS[0]), ("stale", PROMPTS[1])):
        spec = pb.RequestSpec(request_id=rid, tenant="acme", tier="interactive", prompt_token_ids=prompt,
                              sampling=gen_pb.SamplingParams(max_tokens=6, ignore_eos=True), arrival_ms=now_ms())
        assert rig.store.submit(spec).kind == "created"
        (claimed,) = rig.store.claim([(rid, "decode-here")], "decode-here")
        key = ("prefill", rid, claimed.epoch)
        rig.runner.allocate(key)
        token = int(rig.runner.prefill([PrefillItem(key, prompt, 0)])[0].argmax())
        handed.append(Arrived(pb.KVHeader(spec=spec, epoch=claimed.epoch, generated_token_ids=[token],
                                          num_tokens=len(prompt)), key))
        items.append(StepItem(rid, claimed.epoch, 0, token, ""))
        moves.append((rid, claimed.epoch, State.DECODING, {"decode_worker": "here"}))
    assert rig.store.requeue("stale", 1, "moved on", 3) == "QUEUED"  # its attempt is stale now
    answers = []

    def then(kept, moved):
        answers.append((kept, moved))
        for (rid, *_), ok in zip(moves, moved):
            rig.loop.first_written(rid, ok)

    for arrived in handed:
        rig.loop.arrive(arrived, moved=True)
    rig.loop.writes.ride_along(RideAlong(items, moves, then))
    assert rig.stream("kept") == []  # nothing sent before the loop's next step
    rig.loop._step()
    assert answers == [] and rig.loop.writes.sent[3]  # sent with the step (its tokens 1 after their tokens 0), reply unread
    while rig.loop.busy:
        rig.loop._step()
    rig.loop.settle()
    assert answers == [([True, False], [Moved(deadline_ms=0), False])]
    assert rig.record("kept")["state"] == "COMPLETED"
    assert [i for i, _ in rig.stream("kept")] == list(range(6)) and rig.stream("stale") == []
    assert rig.left == ["stale", "kept"] and rig.record("stale")["state"] == "QUEUED"
    assert rig.runner.free_tokens == rig.runner.capacity_tokens
