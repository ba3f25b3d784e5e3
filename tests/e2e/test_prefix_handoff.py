"""A KV hand-off leaves out the prefix the decode worker already holds: separate prefill and
decode processes, a real model; the decode worker's heartbeat names its cached blocks, the
scheduler tells the prefill worker how much of a prompt's K/V the hand-off may skip, and the
output is what the model alone generates."""

import time

import pytest
import redis

from pdq.client import Client
from pdq.ops.up import Cluster
from tests import oracles

MODEL = "builtin:tiny"
SYSTEM = "You are the assistant of a test of pdq's hand-off. Answer briefly, exactly and politely. " * 3


@pytest.fixture(scope="module")
def cluster():
    # Heartbeats every 30 s: what the scheduler learns sooner, it learns from a beat the news itself
    # brought on. Decode steps slowed to 20 ms, so a request of 300 tokens is still running seconds on.
    env = {"PDQ_HEARTBEAT_S": "30", "PDQ_WORKER_TIMEOUT_S": "120", "PDQ_FAULTS": "decode_step_delay_ms=20"}
    with Cluster(model=MODEL, port=0, prefill=1, decode=1, colocate=False, auth=False, extra_env=env) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return oracles.reference(MODEL)


def prefixes(cluster: Cluster) -> set[str]:
    """The cached block hashes the decode worker's latest heartbeat named."""
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        (wid,) = r.zrange("pdq:workers:decode", 0, -1)
        return set((r.hget(f"pdq:worker:{wid}", "prefixes") or "").split())
    finally:
        r.close()


def state(cluster: Cluster, rid: str) -> str:
    with redis.Redis.from_url(cluster.redis_url, decode_responses=True) as r:
        return r.hget(f"pdq:req:{rid}", "state")


def test_a_decode_worker_names_a_hand_offs_blocks_at_once_not_at_its_next_heartbeat(cluster):
    before = prefixes(cluster)
    with Client(cluster.target) as client:
        stream = client.generate_stream("Once upon a time, in a land of long prompts and longer stories, " * 2,
                                        max_tokens=300, ignore_eos=True)
        rid = next(stream).request_id
        next(stream), next(stream)  # the prefill worker's token, then the decode worker's: the K/V arrived
        deadline = time.monotonic() + 10  # a third of the heartbeat period
        while not prefixes(cluster) - before:
            assert time.monotonic() < deadline, "the hand-off's blocks were not reported before the next heartbeat"
            time.sleep(0.02)
        assert state(cluster, rid) == "DECODING"  # still running: no seat freed, the arrival was the news
        client.cancel(rid)


def test_a_hand_off_skips_the_prefix_the_decode_worker_holds_and_the_output_is_unchanged(cluster, reference):
    prefill = next(c for c in cluster.children if c.name.startswith("prefill-"))
    with Client(cluster.target) as client:
        first = client.generate(SYSTEM + "What is pdq?", max_tokens=6, ignore_eos=True)
        assert first.token_ids == oracles.hf_greedy(reference, SYSTEM + "What is pdq?", 6)
        deadline = time.monotonic() + 30
        while not prefixes(cluster):  # the decode worker's heartbeat names the blocks it got
            assert time.monotonic() < deadline, "the decode worker never reported its cached prefix"
            time.sleep(0.05)
        before = oracles.scrape(prefill.metrics_url(cluster.host))
        questions = ["How are you?", "Name a prime number.", "What comes after Monday?"]
        results = [client.generate(SYSTEM + q, max_tokens=6, ignore_eos=True) for q in questions]
    after = oracles.scrape(prefill.metrics_url(cluster.host))
    for q, result in zip(questions, results):
        assert result.token_ids == oracles.hf_greedy(reference, SYSTEM + q, 6), q
    skipped = (oracles.value(after, "pdq_kv_transfer_skipped_tokens_total")
               - oracles.value(before, "pdq_kv_transfer_skipped_tokens_total"))
    prompt = results[0].prompt_tokens
    assert skipped >= len(questions) * (prompt // 2)  # most of every prompt is the shared system part
    sent = (oracles.value(after, "pdq_kv_transfer_bytes_total", outcome="ok")
            - oracles.value(before, "pdq_kv_transfer_bytes_total", outcome="ok"))
    full = oracles.value(before, "pdq_kv_transfer_bytes_total", outcome="ok") / first.prompt_tokens  # bytes a position
    assert sent < len(questions) * prompt * full / 2
