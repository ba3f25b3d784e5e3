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
    with Cluster(model=MODEL, port=0, prefill=1, decode=1, colocate=False, auth=False,
                 extra_env={"PDQ_HEARTBEAT_S": "0.2"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    return oracles.reference(MODEL)


def prefixes(cluster: Cluster) -> str:
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    try:
        (wid,) = r.zrange("pdq:workers:decode", 0, -1)
        return r.hget(f"pdq:worker:{wid}", "prefixes") or ""
    finally:
        r.close()


def test_a_hand_off_skips_the_prefix_the_decode_worker_holds_and_the_output_is_unchanged(cluster, reference):
    prefill = next(c for c in cluster.children if c.name.startswith("prefill-"))
    with Client(cluster.target) as client:
        first = client.generate(SYSTEM + "What is pdq?", max_tokens=6, ignore_eos=True)
        assert first.token_ids == oracles.hf_greedy(reference, SYSTEM + "What is pdq?", 6)
        deadline = time.monotonic() + 30
        while not prefixes(cluster):  # the decode worker's next heartbeat names the blocks it got
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
