"""One request through all five hops: gateway -> scheduler (Redis) -> prefill -> KV hand-off
-> decode -> tokens streamed back. Greedy output must equal transformers' own generate()."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdq.v1 import generation_pb2 as gen_pb
from tests import oracles
from tests.streams import streamed

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\n# a longer prompt that spans several chunks\n" + "lorem ipsum dolor " * 70,
    "Ünïcödé ✓ 日本語 🙂 mixed text",
]


@pytest.fixture(scope="module")
def reference():
    return oracles.reference("builtin")


def test_greedy_output_equals_transformers_generate_for_concurrent_prompts(client, reference):
    lengths = [24, 12, 20, 16]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda a: client.generate(a[0], max_tokens=a[1], ignore_eos=True), zip(PROMPTS, lengths)))
    for prompt, n, result in zip(PROMPTS, lengths, results):
        assert result.token_ids == oracles.hf_greedy(reference, prompt, n), prompt[:30]
        assert result.finish_reason == "length"
        assert result.completion_tokens == n
        assert result.prompt_tokens == len(reference[1](prompt, add_special_tokens=False).input_ids)
    assert results[2].prompt_tokens > 512  # the long prompt was prefilled in chunks


def test_stream_sends_every_index_once_in_order_and_ends_with_usage(client):
    msgs = list(client.generate_stream(PROMPTS[1], max_tokens=10, ignore_eos=True))
    assert msgs[0].request_id and not msgs[0].HasField("index")
    last = msgs[-1]
    assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 10
    assert last.timings.ttft_ms > 0 and last.timings.e2e_ms >= last.timings.ttft_ms
    unary = client.generate(PROMPTS[1], max_tokens=10, ignore_eos=True)
    assert streamed(msgs) == (list(range(10)), unary.token_ids)
    assert "".join(m.text for m in msgs) == unary.text


def test_a_stream_interval_sends_whole_writes_the_first_token_alone(client, store_client):
    """Each message carries one or more whole entries of the worker (the first token alone,
    then groups of 4 steps), never part of one."""
    msgs = list(client.generate_stream(PROMPTS[1], max_tokens=30, ignore_eos=True, stream_interval=4))
    entries = [f for _, f in store_client.xrange(f"pdq:req:{msgs[0].request_id}:out") if b"i" in f]
    sizes = [len(f[b"t"].split(b",")) for f in entries]
    assert sizes[0] == 1 and all(1 <= n <= 4 for n in sizes) and sum(sizes) == 30
    assert sizes[2:-1] == [4] * (len(sizes) - 3)  # whole groups of 4 steps between the first and last writes
    written = {int(f[b"i"]) for f in entries}  # where each entry starts
    tokens = [m for m in msgs if m.HasField("index")]
    assert {m.index for m in tokens} <= written and all(m.index + len(m.token_ids) in written | {30} for m in tokens)
    unary = client.generate(PROMPTS[1], max_tokens=30, ignore_eos=True)
    assert streamed(msgs) == (list(range(30)), unary.token_ids)
    assert "".join(m.text for m in tokens) == unary.text
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH and msgs[-1].usage.completion_tokens == 30


def test_a_unary_call_has_its_tokens_written_in_groups_and_a_submitted_one_by_one(client, store_client):
    def entry_sizes(rid):
        return [len(f[b"t"].split(b",")) for _, f in store_client.xrange(f"pdq:req:{rid}:out") if b"i" in f]

    unary = client.generate("nobody watches", max_tokens=40, ignore_eos=True, request_id="unary-groups-1")
    rid = store_client.get("pdq:idem:acme:unary-groups-1").decode()
    sizes = entry_sizes(rid)
    assert sum(sizes) == 40 and len(unary.token_ids) == 40
    assert sizes[0] == 1 and max(sizes) > 1 and len(sizes) <= 2 + 39 // 16 + 1  # every 16 steps (gateway default)
    submitted = client.submit("somebody may watch", max_tokens=12, ignore_eos=True)  # to stream later
    assert client.get_result(submitted, wait_ms=30_000).done
    assert entry_sizes(submitted) == [1] * 12


def test_the_decode_worker_writes_a_streamed_interval_of_tokens_at_once(client, store_client):
    """Redis sees a request's tokens in groups of its stream interval: one write per 8 decode
    steps, so while it decodes its token count takes at most 160 / 8 + 2 values."""
    rid = client.submit("hold my tokens", max_tokens=160, ignore_eos=True, stream_interval=8)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state, n_out = (v.decode() if v else "" for v in store_client.hmget(f"pdq:req:{rid}", "state", "n_out"))
        if state == "DECODING":
            seen.append(int(n_out))
        elif state == "COMPLETED":
            break
        time.sleep(0.002)
    assert state == "COMPLETED" and int(n_out) == 160
    assert len(seen) >= 60, f"too few samples while decoding: {len(seen)}"
    assert 2 <= len(set(seen)) <= 160 // 8 + 2, sorted(set(seen))
    entries = [f for _, f in store_client.xrange(f"pdq:req:{rid}:out") if b"i" in f]
    sizes = [len(f[b"t"].split(b",")) for f in entries]
    # the first token alone, then one entry per 8 steps: whole groups but the first and last
    assert sizes[0] == 1 and all(1 <= n <= 8 for n in sizes) and sizes[2:-1] == [8] * (len(sizes) - 3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", temperature=-1.0), "sampling.temperature"),
    (dict(prompt="hi", max_tokens=100_000), "sampling.max_tokens"),
    (dict(prompt="hi", max_tokens=4, min_tokens=5), "sampling.min_tokens"),
    (dict(prompt="hi", tier="vip"), "tier"),
    (dict(prompt="hi", request_id="bad id!"), "request_id"),
    (dict(prompt=[10**7]), "prompt_token_ids[0]"),
    (dict(prompt="hi", stream_interval=257), "stream_interval"),
    (dict(prompt="hi", n=17), "n"),
])
def test_invalid_requests_get_invalid_argument_naming_the_field(client, store_client, kwargs, field):
    before = store_client.dbsize()
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":")
    assert store_client.dbsize() == before  # nothing reached Redis


def test_same_request_id_gives_the_same_request(client):
    a = client.generate("idempotent", max_tokens=6, request_id="retry-me-1", temperature=1.0)
    b = client.generate("idempotent", max_tokens=6, request_id="retry-me-1", temperature=1.0)
    assert a.request_id == b.request_id and a.token_ids == b.token_ids


def test_seeded_sampling_is_reproducible_through_the_service(client):
    a = client.generate("sample me", max_tokens=12, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    b = client.generate("sample me", max_tokens=12, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    c = client.generate("sample me", max_tokens=12, temperature=0.9, top_p=0.9, seed=43, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def wait_state(store_client, rid: str, states: set[str], timeout_s: float = 10.0) -> str:
    """Polls the record until it reaches one of `states` (the record lives in another process)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = (store_client.hget(f"pdq:req:{rid}", "state") or b"").decode()
        if state in states:
            return state
        time.sleep(0.02)
    raise AssertionError(f"{rid} never reached {states}; last {state!r}")


def test_n_completions_of_one_prompt_through_generate_and_generate_stream(client, store_client):
    one = client.generate("choose", max_tokens=6, temperature=1.0, seed=21, ignore_eos=True)
    got = client.generate("choose", max_tokens=6, temperature=1.0, seed=21, ignore_eos=True, n=3,
                          request_id="n-choices")
    assert [c.token_ids for c in got.choices][0] == one.token_ids == got.token_ids  # choice 0: the seed itself
    assert len({tuple(c.token_ids) for c in got.choices}) > 1  # choice i samples with seed + i
    assert got.completion_tokens == 18 and got.prompt_tokens == one.prompt_tokens
    assert len({c.request_id for c in got.choices}) == 3
    again = client.generate("choose", max_tokens=6, temperature=1.0, seed=21, ignore_eos=True, n=3,
                            request_id="n-choices")  # a retry: the same requests (ID, ID.1, ID.2)
    assert [c.request_id for c in again.choices] == [c.request_id for c in got.choices]
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ends = {}
    for msg in client.generate_stream("choose", max_tokens=6, temperature=1.0, seed=21, ignore_eos=True, n=3):
        tokens[msg.choice] += list(msg.token_ids)
        if msg.finish_reason:
            ends[msg.choice] = msg.usage.completion_tokens
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in got.choices] and ends == {0: 6, 1: 6, 2: 6}
    with pytest.raises(grpc.RpcError) as err:
        client.submit("choose", n=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("n:")


def test_closing_a_stream_of_n_choices_cancels_every_one(client, store_client):
    stream = client.generate_stream("walk away", max_tokens=1500, ignore_eos=True, n=2)
    firsts = {}
    while len(firsts) < 2:
        msg = next(stream)
        if not msg.HasField("index"):
            firsts[msg.choice] = msg.request_id
    stream.close()
    assert [wait_state(store_client, rid, {"CANCELLED"}) for rid in firsts.values()] == ["CANCELLED"] * 2


def test_cancel_rpc_ends_a_running_stream_with_cancelled(client, store_client):
    stream = client.generate_stream("cancel me", max_tokens=1500, ignore_eos=True)
    rid = next(stream).request_id
    next(stream)  # a token: it is running
    assert client.cancel(rid) == "CANCELLED"
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert wait_state(store_client, rid, {"CANCELLED"}) == "CANCELLED"
    assert client.cancel(rid) == "CANCELLED"  # idempotent


def test_closing_the_stream_cancels_the_request(client, store_client):
    stream = client.generate_stream("walk away", max_tokens=1500, ignore_eos=True)
    rid = next(stream).request_id
    next(stream)
    stream.close()
    assert wait_state(store_client, rid, {"CANCELLED"}) == "CANCELLED"


def test_deadline_of_the_call_ends_the_request(client, store_client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate("slow", max_tokens=1500, ignore_eos=True, request_id="deadline-1", timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    rid = store_client.get("pdq:idem:acme:deadline-1").decode()
    assert wait_state(store_client, rid, {"TIMED_OUT"}) == "TIMED_OUT"


def test_unknown_request_cannot_be_cancelled(client):
    with pytest.raises(grpc.RpcError) as err:
        client.cancel("no-such-request")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_nothing_leaks_after_the_requests_end(cluster, store_client, client):
    client.generate("one more", max_tokens=4)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = {k.decode(): int(v) for k, v in store_client.hgetall("pdq:load").items()}
        queued, running = load.get("n", 0), load.get("running", 0)
        workers = [store_client.hgetall(f"pdq:worker:{w.decode()}") for w in store_client.zrange("pdq:workers:decode", 0, -1)]
        if queued == 0 and running == 0 and workers and all(w[b"free_slots"] == w[b"capacity"] for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError(f"queued {queued}, running {running}, decode workers {workers}")


def test_decode_workers_yield_the_cpu_to_the_rest(cluster):
    """`pdq up` runs decode workers nicer: on a busy machine prefill and the control plane go
    first. Prefill takes every core when it runs; decode its share, and every core in bursts."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice = {c.name: os.getpriority(os.PRIO_PROCESS, c.process.pid) for c in cluster.children}
    assert {n: v - base for n, v in nice.items() if n.startswith("decode")} == {"decode-0": 5}
    assert all(v == base for n, v in nice.items() if not n.startswith("decode"))

    def env(name: str) -> dict:
        pid = next(c.process.pid for c in cluster.children if c.name == name)
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split("=", 1) for kv in f.read().decode().split("\0") if "=" in kv)

    cores = len(os.sched_getaffinity(0))
    assert env("prefill-0")["PDQ_THREADS"] == str(cores)  # the only prefill worker
    assert (env("decode-0")["PDQ_THREADS"], env("decode-0")["PDQ_BURST_THREADS"]) == (str(max(1, cores // 2)), str(cores))
