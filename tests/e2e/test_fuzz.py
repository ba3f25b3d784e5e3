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
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdq.model.loader import resolve_model
from pdq.v1 import generation_pb2 as gen_pb
from pdq.v1 import generation_pb2_grpc as gen_grpc
from tests.e2e.conftest import KEYS

# Never acceptable, whatever the input: a bug in the server.
BUG = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# The request was not accepted: nothing of it may be in Redis.
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
# The call may have ended before the gateway finished accepting the request: let it settle.
UNSETTLED = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
TERMINAL = {"COMPLETED", "CANCELLED", "TIMED_OUT", "FAILED", "REJECTED"}
CALL_TIMEOUT_S = 30.0

VOCAB = json.loads((resolve_model("builtin") / "config.json").read_text())["vocab_size"]
UINT32 = 2**32 - 1

# -- strategies -----------------------------------------------------------------------------

WEIRD = st.sampled_from(["\x00", "\x7f", "\u200b", "\u202e", "\ufeff", "\ufffd", "\uffff", "\U0010ffff",
                         "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "e\u0301", "\u0300",
                         "日本語", "\r\n", "\t", "<s>", "</s>", "<unk>", "<|endoftext|>", "\\x00", "%s", "{}"])
PROMPTS = st.one_of(
    st.text(max_size=48),  # any code point but lone surrogates (protobuf strings are UTF-8)
    st.lists(WEIRD, max_size=12).map("".join),
    st.builds(operator.mul, st.text(min_size=1, max_size=3), st.integers(600, 2500)),  # near/over max_model_len
)
TOKEN_IDS = st.one_of(
    st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, UINT32]),
                       st.integers(0, UINT32)), max_size=24),
    st.builds(operator.mul, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=1), st.integers(2040, 2060)),
)
FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1e-45, 0.5, 1.0, 10.0, 10.000001, -1.0,
                                                         float("nan"), float("inf"), float("-inf"), 3.4e38]))
SMALL_OR_ANY = st.one_of(st.integers(0, 8), st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1]), st.integers(0, UINT32))
# Small max_tokens (0 = the default, 16) are accepted; the rest are over max_model_len and refused.
MAX_TOKENS = st.one_of(st.integers(0, 6), st.integers(2048, UINT32))
STOPS = st.lists(st.one_of(st.text(max_size=4), st.just(""), st.builds(operator.mul, st.just("s"), st.integers(255, 258))),
                 max_size=10)
SAMPLING = st.builds(
    dict, max_tokens=MAX_TOKENS, temperature=FLOATS, top_k=SMALL_OR_ANY, top_p=FLOATS,
    seed=st.none() | st.integers(0, 2**64 - 1), stop=STOPS, ignore_eos=st.booleans())
CLIENT_IDS = st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True), st.text(max_size=140),
                       st.sampled_from(["fuzz-1", "fuzz-2", "x" * 128, "x" * 129, " ", "a b", "é", "a/b"]))
TIERS = st.one_of(st.sampled_from(["", "interactive", "batch", "Interactive", "batch ", "\x00"]), st.text(max_size=16))
TIMEOUTS = st.one_of(st.just(0), st.integers(1, 50), st.sampled_from([86_400_000, 86_400_001]), st.integers(0, UINT32))


@st.composite
def generate_requests(draw) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(request_id=draw(CLIENT_IDS), tier=draw(TIERS), timeout_ms=draw(TIMEOUTS))
    shape = draw(st.sampled_from(["text", "text", "ids", "both", "neither"]))
    if shape in ("text", "both"):
        req.prompt = draw(PROMPTS)
    if shape in ("ids", "both"):
        req.prompt_token_ids.extend(draw(TOKEN_IDS))
    if draw(st.booleans()):
        sampling = draw(SAMPLING)
        seed = sampling.pop("seed")
        req.sampling.CopyFrom(gen_pb.SamplingParams(**sampling))
        if seed is not None:
            req.sampling.seed = seed
    return req


# -- bookkeeping of what the fuzzed calls left in Redis --------------------------------------------


@dataclass
class Ledger:
    """Request records and idempotency keys in Redis, attributed to the calls that made them."""

    redis: redis.Redis
    known: set[str] = field(default_factory=set)     # keys seen so far
    accepted: set[str] = field(default_factory=set)  # request ids made by accepted calls
    leaks: list[str] = field(default_factory=list)

    def keys(self) -> set[str]:
        return {k.decode() for pattern in ("pdq:req:*", "pdq:idem:*") for k in self.redis.scan_iter(pattern, count=1000)}

    def start(self) -> "Ledger":
        self.known = self.keys()
        return self

    def settle(self, what: str, code: grpc.StatusCode) -> None:
        """Attributes the keys that appeared during the last call to it."""
        if code in UNSETTLED:
            time.sleep(0.3)
        now = self.keys()
        new, self.known = now - self.known, now
        rids = {k.split(":")[2] for k in new if k.startswith("pdq:req:")}
        if code not in REFUSED:
            self.accepted |= rids
            return
        late = {k for k in new if k.startswith("pdq:idem:")} | {f"pdq:req:{r}" for r in rids - self.accepted}
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # admission may record a REJECTED request
            late = {k for k in late if self.redis.hget(k, "state") != b"REJECTED"}
        if late:
            self.leaks.append(f"{what} ended {code.name} but left {sorted(late)}")

    def wait_all_terminal(self, timeout_s: float = 60.0) -> dict[str, str]:
        """-> the accepted requests still not terminal after timeout_s (id -> state)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {rid: (self.redis.hget(f"pdq:req:{rid}", "state") or b"").decode() for rid in self.accepted}
            open_ = {rid: s for rid, s in states.items() if s not in TERMINAL}
            if not open_ or time.monotonic() > deadline:
                return open_
            time.sleep(0.2)


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


def check_clean_end(cluster, ledger: Ledger, store_client) -> None:
    assert not ledger.leaks, "\n".join(ledger.leaks)
    assert cluster.dead_child() is None, f"{cluster.dead_child().name} died"
    assert ledger.wait_all_terminal() == {}, "accepted requests that never ended"
    queued = [r for r in ledger.accepted if store_client.zscore("pdq:queue", r) is not None]
    with_deadline = [r for r in ledger.accepted if store_client.zscore("pdq:deadlines", r) is not None]
    assert queued == [] and with_deadline == [], "ended requests left in the queue"


# -- the fuzz tests ----------------------------------------------------------------------------


def test_fuzzed_generate_requests_get_a_deliberate_status_and_leave_nothing_when_refused(
        cluster, stub, ledger, store_client):
    failures: list[str] = []

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(req=generate_requests(), rpc=st.sampled_from(["Generate", "GenerateStream", "Submit"]),
           close_after=st.none() | st.integers(0, 2), call_timeout=st.just(CALL_TIMEOUT_S) | st.floats(0.001, 0.3))
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

        code, result = outcome(call)
        ledger.settle(f"{rpc}({req!r:.300})", code)
        if code in BUG:
            failures.append(f"{rpc} -> {code.name} {result.details()!r} for {req!r:.500}")
        elif code == grpc.StatusCode.OK and rpc == "GenerateStream" and close_after is None:
            indices = [m.index for m in result if m.HasField("index")]
            assert indices == list(range(len(indices))), f"stream indices {indices} for {req!r:.300}"
            assert result[-1].finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
        elif code == grpc.StatusCode.OK and rpc == "Generate":
            assert result.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
            assert len(result.token_ids) == result.usage.completion_tokens

    run()
    assert not failures, "\n".join(failures)
    check_clean_end(cluster, ledger, store_client)


def test_fuzzed_request_ids_for_get_result_cancel_and_stream_result(cluster, stub, client, ledger, store_client):
    seeded = [client.submit("fuzz seed", max_tokens=4),
              client.submit("fuzz seed", max_tokens=4, request_id="fuzz-seed-key"),
              client.submit("a longer one", max_tokens=200, ignore_eos=True)]
    ledger.start()
    ledger.accepted.update(seeded)
    failures: list[str] = []
    ids = st.one_of(st.sampled_from(seeded + ["fuzz-seed-key", seeded[0].upper(), seeded[0] + " ", "pdq:req:" + seeded[0]]),
                    st.text(max_size=140), st.from_regex(r"[0-9a-f]{32}", fullmatch=True), st.just(""),
                    st.just("x" * 100_000))

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
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

        code, result = outcome(call)
        ledger.settle(f"{rpc}({request_id!r:.100})", grpc.StatusCode.NOT_FOUND)  # never makes a request
        if code in BUG:
            failures.append(f"{rpc}(request_id={request_id!r:.200}, wait_ms={wait_ms}, offset={offset}) -> "
                            f"{code.name} {result.details()!r}")
        elif code == grpc.StatusCode.OK and rpc == "StreamResult" and close_after is None:
            indices = [m.index for m in result if m.HasField("index")]
            assert indices == list(range(min(offset, len(indices) + offset), offset + len(indices)))

    run()
    assert not failures, "\n".join(failures)
    check_clean_end(cluster, ledger, store_client)
