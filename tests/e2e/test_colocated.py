"""A colocated worker (`pdq up --colocate`: `decode_worker --colocate`) serves both worker roles in
one process: prompt chunks and decode rows share forward passes, and its hand-off to itself keeps
the K/V in the pool. Greedy output of a mixed batch (prompts chunked into passes that also carry
other sequences' decode rows, a request joining mid-flight) still equals transformers' generate()
of each request alone, and every KV slot comes back after finishes and cancels."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from pdq.client import Client
from pdq.config import TIERS
from pdq.state.store import SyncStore
from tests.streams import streamed as streamed_tokens, until_tokens
from pdq.ops.up import Cluster
from tests import oracles

MODEL = "builtin:tiny"
CHUNK = 8  # prompt tokens per sequence per pass: every prompt below spans several passes
KV_BUDGET, MAX_SEQ_LEN = 8192, 1024


@pytest.fixture(scope="module")
def cluster():
    env = {"PDQ_PREFILL_CHUNK": str(CHUNK), "PDQ_STEP_TOKENS": "64", "PDQ_HEARTBEAT_S": "0.2",
           "PDQ_KV_BUDGET_TOKENS": str(KV_BUDGET), "PDQ_MAX_SEQ_LEN": str(MAX_SEQ_LEN)}
    with Cluster(model=MODEL, port=0, colocate=True, auth=False, extra_env=env) as c:
        yield c


@pytest.fixture
def rdb(cluster):
    with redis.Redis.from_url(cluster.redis_url, decode_responses=True) as r:
        yield r


@pytest.fixture(scope="module")
def reference():
    return oracles.reference(MODEL)


def workers(rdb: redis.Redis, role: str) -> list[dict]:
    return [rdb.hgetall(f"pdq:worker:{w}") for w in rdb.zrange(f"pdq:workers:{role}", 0, -1)]


def all_slots_free(rdb: redis.Redis) -> bool:
    """The colocated pool (its prefill role's entry) and the decode holds are all free."""
    (prefill,), (decode,) = workers(rdb, "prefill"), workers(rdb, "decode")
    return (int(prefill["free_slots"]) == int(prefill["capacity"])
            and int(decode["free_slots"]) == int(decode["capacity"]) and decode["running"] == "0")


def wait_for(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)
    return got


def test_one_process_serves_both_roles_at_one_address(cluster, rdb):
    assert [c.name for c in cluster.children if "prefill" in c.name] == []
    (prefill,), (decode,) = workers(rdb, "prefill"), workers(rdb, "decode")
    assert prefill["address"] == decode["address"]


def test_the_decode_role_reports_the_kv_budget_it_may_use_and_the_prefill_role_the_whole_pool(cluster, rdb):
    """The pool also keeps room for 4 prompts this process prefills for other decode workers;
    the decode role cannot grant it, so its reported total (what the scheduler's KV-fit check at
    submit reads) leaves it out: a request bigger than the budget is refused, not queued forever."""
    wait_for("both roles' pools", lambda: all(w.get("kv_total_tokens") for r in ("prefill", "decode")
                                               for w in workers(rdb, r)))
    (prefill,), (decode,) = workers(rdb, "prefill"), workers(rdb, "decode")
    assert int(decode["kv_total_tokens"]) == KV_BUDGET
    assert int(prefill["kv_total_tokens"]) == KV_BUDGET + 4 * MAX_SEQ_LEN
    assert int(decode["kv_free_tokens"]) <= KV_BUDGET


def test_the_model_process_keeps_the_cores_and_the_rest_run_under_batch(cluster):
    """pdq up's control plane (Redis, scheduler, gateway) yields the cores to the model's threads
    (pdq.ops.cpu): every thread of it runs under SCHED_BATCH, every thread of the worker under normal."""
    def policies(pid: int) -> set[int]:
        return {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}

    by_name = {c.name: c.process.pid for c in cluster.children}
    assert set(by_name) == {"scheduler", "decode-0", "gateway"}
    assert policies(by_name["decode-0"]) == {os.SCHED_OTHER}
    for pid in (by_name["scheduler"], by_name["gateway"], cluster.redis.process.pid):
        assert policies(pid) == {os.SCHED_BATCH}


def test_mixed_batch_equals_generate_alone_and_hands_off_in_place(cluster, reference):
    worker = next(c for c in cluster.children if c.name.startswith("decode-"))
    before = oracles.scrape(worker.metrics_url(cluster.host))
    jobs = [("Hello", 30), ("The quick brown fox jumps over the lazy dog. " * 3, 12),
            ("def add(a, b):\n    return a + b\n" * 4, 25), ("lorem ipsum dolor sit amet " * 6, 8)]
    late = ("a request that joins while the others decode", 10)
    with Client(cluster.target) as client:
        first = client.generate_stream(jobs[0][0], max_tokens=jobs[0][1], ignore_eos=True)
        head = [next(first), *until_tokens(first, 1)]  # the request id, then a token: the batch is decoding
        with ThreadPoolExecutor(len(jobs)) as pool:
            rest = [pool.submit(client.generate, p, max_tokens=n, ignore_eos=True) for p, n in jobs[1:] + [late]]
            streamed = head + list(first)
            results = [f.result() for f in rest]
    first_tokens = streamed_tokens(streamed)[1]
    assert first_tokens == oracles.hf_greedy(reference, *jobs[0])
    for (prompt, n), result in zip(jobs[1:] + [late], results):
        assert result.prompt_tokens > CHUNK  # prefilled over several passes
        assert result.token_ids == oracles.hf_greedy(reference, prompt, n), prompt[:30]
    after = oracles.scrape(worker.metrics_url(cluster.host))
    local = (oracles.value(after, "pdq_kv_transfer_seconds_count", outcome="ok", transport="local")
             - oracles.value(before, "pdq_kv_transfer_seconds_count", outcome="ok", transport="local"))
    assert local == len(jobs) + 1  # every hand-off stayed in the pool
    assert oracles.value(after, "pdq_kv_transfer_bytes_total") == 0


def test_cancel_and_finish_give_every_slot_back(cluster, rdb):
    with Client(cluster.target) as client:
        stream = client.generate_stream("cancel me midway " * 5, max_tokens=1000, ignore_eos=True)
        rid = next(stream).request_id
        next(stream)  # decoding
        done = threading.Thread(target=client.generate, args=("finish me",), kwargs={"max_tokens": 6})
        done.start()
        assert client.cancel(rid) == "CANCELLED"
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
        done.join(60)
    wait_for("every KV slot free again", lambda: all_slots_free(rdb))


def test_requests_that_end_in_one_step_all_give_their_slots_back(cluster, rdb):
    """Sequences that finish in the same decode step (one Redis write: one finished_ms) free
    their K/V before that write and release their holds in one notice after it: all of it."""
    store = SyncStore(redis.Redis.from_url(cluster.redis_url))
    for tier in TIERS:  # queue them all, then let one dispatch take them together
        store.pause(tier=tier)
    try:
        with Client(cluster.target) as client:
            rids = [client.submit("one step", max_tokens=5, ignore_eos=True) for _ in range(4)]
            for tier in TIERS:
                store.pause(tier=tier, paused=False)
            done = [client.get_result(rid, wait_ms=30_000) for rid in rids]
    finally:
        for tier in TIERS:
            store.pause(tier=tier, paused=False)
        store.client.close()
    assert all(d.done and d.state == "COMPLETED" and len(d.result.token_ids) == 5 for d in done)
    finished = [rdb.hget(f"pdq:req:{rid}", "finished_ms") for rid in rids]
    assert len(set(finished)) == 1, f"not one step: {finished}"
    wait_for("every KV slot free again", lambda: all_slots_free(rdb))


def test_a_local_hand_off_after_its_reservation_expired_fails_cleanly_and_frees_the_slot():
    """The prefill role hands a prompt to the decode role of its own process only under the
    reservation the scheduler took; one that expired during a long prefill is refused as a
    PushKV would be: the slot is freed, the attempt fails and the scheduler retries, then FAILS."""
    env = {"PDQ_PREFILL_CHUNK": "8", "PDQ_STEP_TOKENS": "8", "PDQ_HEARTBEAT_S": "0.05",
           "PDQ_RESERVATION_TIMEOUT_S": "0.05", "PDQ_FAULTS": "decode_step_delay_ms=50"}  # passes of >= 50 ms
    with (Cluster(model=MODEL, port=0, colocate=True, auth=False, metrics_port=-1, extra_env=env) as c,
          redis.Redis.from_url(c.redis_url, decode_responses=True) as rdb, Client(c.target) as client):
        with pytest.raises(grpc.RpcError) as err:
            client.generate("a prompt long enough to outlive its reservation", max_tokens=4)  # 6+ passes
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no KV reservation" in err.value.details()
        (rid,) = {k.split(":")[2] for k in rdb.keys("pdq:req:*")}
        state, error = rdb.hmget(f"pdq:req:{rid}", "state", "error")
        assert state == "FAILED" and "(local): no KV reservation" in error  # after every attempt failed so
        wait_for("every KV slot free again", lambda: all_slots_free(rdb))
