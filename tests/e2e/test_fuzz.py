"""Fuzzing the public messages against a running gateway (hypothesis).

Whatever a client with a valid key sends, every call ends OK or with a deliberate status (never
INTERNAL or UNKNOWN), no process of the cluster dies, a rejected request leaves nothing in Redis
(no record, no output stream, no idempotency key), and every accepted request reaches a terminal
state and leaves the queue. The model runs on CPU, so accepted requests generate few tokens.
"""

import json
import operator
import time
from dataclasses import dataclass, field

import grpc
import pytest
import redis
from grpc_status import rpc_status
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdq.model.loader import resolve_model
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.conftest import KEYS
from tests.streams import streamed

# Never acceptable, whatever the input: a bug in the server.
BUG = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# The request was not accepted: nothing of it may be in Redis.
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
TERMINAL = {"COMPLETED", "CANCELLED", "TIMED_OUT", "FAILED", "REJECTED"}
CALL_TIMEOUT_S = 30.0

VOCAB = json.loads((resolve_model("builtin") / "config.json").read_text())["vocab_size"]
UINT32 = 2**32 - 1

# -- strategies -----------------------------------------------------------------------------

WEIRD = st.sampled_from(["\x00", "\x7f", "\u200b", "\u202e", "\ufeff", "\ufffd", "\uffff", "\U0010ffff",
                         "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "e\u0301", "\u0300",
                         "日本語", "\r\n", "\t", "<s>", "</s>", "<unk>", "<|endoftext|>", "\\x00", "%s", "{}"])
FLOAT_EDGES = [0.0, -0.0, 1e-45, 1e-7, 0.5, 1.0, 10.0, 10.000001, -1.0, 3.4e38, float("nan"), float("inf"),
               float("-inf")]
SEEDS = st.none() | st.integers(0, 2**64 - 1)

# Each field has a valid strategy (edge values included) and a wild one (anything the wire allows).
VALID = {
    "prompt": st.one_of(
        st.text(min_size=1, max_size=48),  # any code point but lone surrogates (protobuf strings are UTF-8)
        st.lists(WEIRD, min_size=1, max_size=12).map("".join),
        st.builds(operator.mul, st.text(min_size=1, max_size=3), st.integers(300, 1500)),  # long: chunked prefill
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),  # token ids
    ),
    "max_tokens": st.integers(0, 6),  # 0 = the server default (16)
    "temperature": st.one_of(st.floats(0, 10, width=32), st.sampled_from([0.0, -0.0, 1e-45, 10.0])),
    "top_k": st.one_of(st.integers(0, 8), st.sampled_from([VOCAB - 1, VOCAB])),
    "top_p": st.one_of(st.floats(0, 1, width=32), st.sampled_from([0.0, 1e-45, 1e-7, 1.0])),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=8),
    "request_id": st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True),
                            st.sampled_from(["fuzz-1", "fuzz-2", "x" * 128])),
    "tier": st.sampled_from(["", "interactive", "batch"]),
    "timeout_ms": st.one_of(st.just(0), st.integers(1, 50), st.integers(0, 86_400_000)),  # 1..50: times out
}
WILD = {
    "prompt": st.one_of(
        st.just(""), st.text(max_size=48),
        st.builds(operator.mul, st.text(min_size=1, max_size=3), st.integers(1500, 5000)),  # over max_model_len
        st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 2**32 - 1]),
                           st.integers(0, 2**32 - 1)), max_size=24),
        st.builds(operator.mul, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1), st.integers(2040, 2060)),
        st.tuples(st.text(min_size=1, max_size=8), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
    ),
    # Always over max_model_len (refused): long generations are too slow on CPU.
    "max_tokens": st.one_of(st.just(2048), st.integers(2048, 2**32 - 1)),
    "temperature": st.one_of(st.floats(width=32), st.sampled_from(FLOAT_EDGES)),
    "top_k": st.one_of(st.sampled_from([VOCAB + 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    "top_p": st.one_of(st.floats(width=32), st.sampled_from(FLOAT_EDGES)),
    "stop": st.lists(st.one_of(st.just(""), st.text(max_size=8),
                               st.builds(operator.mul, st.just("s"), st.integers(255, 258))), max_size=10),
    "request_id": st.one_of(st.text(max_size=140), st.sampled_from(["x" * 129, " ", "a b", "é", "a/b", "\x00"])),
    "tier": st.one_of(st.sampled_from(["Interactive", "batch ", "\x00", "default"]), st.text(max_size=16)),
    "timeout_ms": st.one_of(st.sampled_from([86_400_000, 86_400_001]), st.integers(0, 2**32 - 1)),
}


@st.composite
def generate_requests(draw) -> gen_pb.GenerateRequest:
    """Valid requests, requests with one wild field, and requests with every field wild."""
    mode = draw(st.sampled_from(["valid", "valid", "one wild field", "all wild"]))
    wild = set(WILD) if mode == "all wild" else {draw(st.sampled_from(sorted(WILD)))} if mode != "valid" else set()
    value = {name: draw((WILD if name in wild else VALID)[name]) for name in VALID}
    req = gen_pb.GenerateRequest(request_id=value["request_id"], tier=value["tier"], timeout_ms=value["timeout_ms"])
    prompt = value["prompt"]
    if isinstance(prompt, tuple):  # both a text and token ids
        req.prompt, _ = prompt
        req.prompt_token_ids.extend(prompt[1])
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    if draw(st.booleans()) or mode != "valid":
        req.sampling.CopyFrom(gen_pb.SamplingParams(
            max_tokens=value["max_tokens"], temperature=value["temperature"], top_k=value["top_k"],
            top_p=value["top_p"], stop=value["stop"], ignore_eos=draw(st.booleans())))
        seed = draw(SEEDS)
        if seed is not None:
            req.sampling.seed = seed
    return req


# -- bookkeeping of what the fuzzed calls left in Redis --------------------------------------------


@dataclass
class Ledger:
    """Request records, output streams and idempotency keys in Redis, attributed to the calls
    that made them: a refused call must make none."""

    redis: redis.Redis
    known: set[str] = field(default_factory=set)     # keys seen so far
    accepted: set[str] = field(default_factory=set)  # request ids made by accepted calls

    def keys(self) -> set[str]:
        return {k.decode() for pattern in ("pdq:req:*", "pdq:idem:*") for k in self.redis.scan_iter(pattern, count=1000)}

    def start(self) -> "Ledger":
        self.known = self.keys()
        return self

    def request_id(self, key: str) -> str:
        if key.startswith("pdq:idem:"):
            return (self.redis.get(key) or b"").decode()
        return key.split(":")[2]  # pdq:req:{id} or pdq:req:{id}:out

    def settle(self, what: str, code: grpc.StatusCode, started_ms: int) -> None:
        """Attributes the keys that appeared since the last call; a refused call that began at
        started_ms may only see keys of requests created before it (late writes of earlier calls)."""
        now = self.keys()
        new, self.known = now - self.known, now
        rids = {self.request_id(k): k for k in new}
        if code not in REFUSED:
            self.accepted |= rids.keys()
            return
        for rid, key in rids.items():
            if rid in self.accepted:
                continue
            created = self.redis.hget(f"pdq:req:{rid}", "created_ms")
            assert created is not None and int(created) < started_ms, (
                f"{what} ended {code.name} but left {key} (request created_ms {created}, call began {started_ms})")
            self.accepted.add(rid)

    def wait_all_terminal(self, timeout_s: float = 60.0) -> dict[str, str]:
        """-> the accepted requests still not terminal after timeout_s (id -> state)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {rid: (self.redis.hget(f"pdq:req:{rid}", "state") or b"").decode() for rid in self.accepted}
            open_ = {rid: s for rid, s in states.items() if s not in TERMINAL}
            if not open_ or time.monotonic() > deadline:
                return open_
            time.sleep(0.2)

    def still_indexed(self) -> dict[str, list[str]]:
        """Sorted sets (queues, deadlines, leases) that still hold accepted requests -> their ids.
        (The request index of ListRequests keeps ended requests as long as their records.)"""
        ids = sorted(self.accepted)
        found = {}
        for key in self.redis.scan_iter("pdq:*", count=1000, _type="ZSET"):
            if key == b"pdq:index" or key.startswith(b"pdq:index:"):
                continue
            held = [rid for rid, score in zip(ids, self.redis.zmscore(key, ids)) if score is not None]
            if held:
                found[key.decode()] = held
        return found


@pytest.fixture
def stub(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        yield gen_grpc.GenerationStub(channel)


@pytest.fixture
def ledger(store_client):
    return Ledger(store_client).start()


META = (("authorization", f"Bearer {KEYS['acme']}"),)


def outcome(call) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, call()
    except grpc.RpcError as exc:
        return exc.code(), exc


def check_status(code: grpc.StatusCode, result, what: str) -> None:
    """The call ended OK or with a status the server chose on purpose."""
    if code == grpc.StatusCode.OK:
        return
    details = result.details() or ""
    assert code not in BUG, f"{what} -> {code.name} {details!r}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # admission control says why (ErrorInfo); a transport limit does not
        status = rpc_status.from_call(result)
        assert status is not None and status.details, f"{what} -> RESOURCE_EXHAUSTED not from pdq: {details!r}"
    if code == grpc.StatusCode.UNAVAILABLE:  # an exception in the scheduler, passed on as UNAVAILABLE
        assert "Unexpected <class" not in details and "Traceback" not in details, f"{what} -> {details!r}"


def check_clean_end(cluster, ledger: Ledger) -> None:
    """Every process alive; every accepted request ended and left every queue and index."""
    time.sleep(0.5)
    ledger.settle("the calls that timed out", grpc.StatusCode.OK, 0)  # late writes of accepted requests
    assert cluster.dead_child() is None, f"{cluster.dead_child().name} died"
    assert ledger.wait_all_terminal() == {}, "accepted requests that never ended"
    if ledger.accepted:
        assert ledger.still_indexed() == {}, "ended requests still in a queue"


# -- the fuzz tests ----------------------------------------------------------------------------


def test_fuzzed_generate_requests_get_a_deliberate_status_and_leave_nothing_when_refused(
        cluster, stub, ledger):
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(req=generate_requests(), rpc=st.sampled_from(["Generate", "GenerateStream", "Submit"]),
           close_after=st.none() | st.integers(0, 2),
           call_timeout=st.sampled_from([CALL_TIMEOUT_S] * 4 + [0.001, 0.02, 0.1, 0.3]))
    @example(req=gen_pb.GenerateRequest(prompt="x" * ((1 << 20) + 1)), rpc="Generate", close_after=None,
             call_timeout=CALL_TIMEOUT_S)
    @example(req=gen_pb.GenerateRequest(prompt="\x00"), rpc="Generate", close_after=None, call_timeout=CALL_TIMEOUT_S)
    @example(req=gen_pb.GenerateRequest(prompt_token_ids=[1, 1, 1], sampling=gen_pb.SamplingParams(
        max_tokens=3, temperature=1.0, top_p=1e-45, top_k=1)), rpc="GenerateStream", close_after=None,
        call_timeout=CALL_TIMEOUT_S)
    def run(req, rpc, close_after, call_timeout):
        def call():
            if rpc == "Generate":
                return stub.Generate(req, metadata=META, timeout=call_timeout)
            if rpc == "Submit":
                return stub.Submit(req, metadata=META, timeout=call_timeout)
            stream = stub.GenerateStream(req, metadata=META, timeout=call_timeout)
            msgs = []
            for msg in stream:
                msgs.append(msg)
                if close_after is not None and len(msgs) > close_after:
                    stream.cancel()  # the client goes away: the request must be cancelled
                    break
            return msgs

        started_ms = int(time.time() * 1000)
        code, result = outcome(call)
        ledger.settle(f"{rpc}({req!r:.300})", code, started_ms)
        check_status(code, result, f"{rpc}({req!r:.500})")
        if code == grpc.StatusCode.OK and rpc == "GenerateStream" and close_after is None:
            indices = streamed(result)[0]
            assert indices == list(range(len(indices))), f"stream indices {indices} for {req!r:.300}"
            assert result[-1].finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
        elif code == grpc.StatusCode.OK and rpc == "Generate":
            assert result.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
            assert len(result.token_ids) == result.usage.completion_tokens

    run()
    check_clean_end(cluster, ledger)


def test_fuzzed_request_ids_for_get_result_cancel_and_stream_result(cluster, stub, client, ledger):
    seeded = [client.submit("fuzz seed", max_tokens=4),
              client.submit("fuzz seed", max_tokens=4, request_id="fuzz-seed-key"),
              client.submit("a longer one", max_tokens=200, ignore_eos=True)]
    ledger.start()
    ledger.accepted.update(seeded)
    ids = st.one_of(st.sampled_from(seeded + ["fuzz-seed-key", seeded[0].upper(), seeded[0] + " ", "pdq:req:" + seeded[0]]),
                    st.text(max_size=140), st.from_regex(r"[0-9a-f]{32}", fullmatch=True), st.just(""))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rpc=st.sampled_from(["GetResult", "Cancel", "StreamResult"]), request_id=ids,
           wait_ms=st.one_of(st.integers(0, 300), st.sampled_from([60_000, 60_001]), st.integers(0, UINT32)),
           offset=st.one_of(st.integers(0, 10), st.integers(0, UINT32)), close_after=st.none() | st.integers(0, 2))
    def run(rpc, request_id, wait_ms, offset, close_after):
        def call():
            if rpc == "GetResult":
                return stub.GetResult(gen_pb.GetResultRequest(request_id=request_id, wait_ms=wait_ms),
                                      metadata=META, timeout=5.0)
            if rpc == "Cancel":
                return stub.Cancel(gen_pb.CancelRequest(request_id=request_id), metadata=META, timeout=5.0)
            stream = stub.StreamResult(gen_pb.StreamResultRequest(request_id=request_id, offset=offset),
                                       metadata=META, timeout=5.0)
            msgs = []
            for msg in stream:
                msgs.append(msg)
                if close_after is not None and len(msgs) > close_after:
                    stream.cancel()
                    break
            return msgs

        started_ms = int(time.time() * 1000)
        code, result = outcome(call)
        ledger.settle(f"{rpc}({request_id!r:.100})", grpc.StatusCode.NOT_FOUND, started_ms)  # never makes a request
        check_status(code, result, f"{rpc}(request_id={request_id!r:.200}, wait_ms={wait_ms}, offset={offset})")
        if code == grpc.StatusCode.OK and rpc == "StreamResult" and close_after is None:
            indices = streamed(result)[0]
            assert indices == list(range(offset, offset + len(indices)))

    run()
    check_clean_end(cluster, ledger)


# Client strings in error messages are capped, so a long invalid value gets its own status
# (not a transport RESOURCE_EXHAUSTED for oversized metadata).
@pytest.mark.parametrize("rpc, message, expected", [
    ("Submit", gen_pb.GenerateRequest(prompt="hi", tier="\U0001f600" * 2000), {grpc.StatusCode.INVALID_ARGUMENT}),
    ("GetResult", gen_pb.GetResultRequest(request_id="x" * 20_000),
     {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}),
], ids=["Submit-tier-2000-emoji", "GetResult-request_id-20000-chars"])
def test_long_invalid_strings_get_their_own_status(stub, rpc, message, expected):
    code, _ = outcome(lambda: getattr(stub, rpc)(message, metadata=META, timeout=10.0))
    assert code in expected
