"""The null model (`--model null`) serves through the whole service path: gateway, scheduler,
Redis, a prefill worker, the KV hand-off and a decode worker, each its own process. Its greedy
output is known in advance (`pdq.model.null.greedy_output`), so every token that reaches the
client checks the hops it crossed."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from pdq.client import Client
from pdq.model.builtin import VOCAB_SIZE
from pdq.model.null import greedy_output
from pdq.ops.up import Cluster
from tests.streams import streamed


@pytest.fixture(scope="module")
def cluster():
    with Cluster(model="null", port=0, prefill=1, decode=1, colocate=False, auth=False,
                 extra_env={"PDQ_HEARTBEAT_S": "0.2"}) as c:
        yield c


def test_a_null_model_cluster_streams_the_null_models_tokens_through_prefill_and_decode_workers(cluster):
    prompts = [[7 + i, 40 + 3 * i, 99] * (1 + i % 5) for i in range(24)]
    with Client(cluster.target) as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=12, timeout=60), prompts))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length"
        assert result.token_ids == greedy_output(prompt, 12, VOCAB_SIZE)


def test_a_null_model_takes_text_prompts_through_the_built_in_tokenizer_and_streams_token_by_token(cluster):
    with Client(cluster.target) as client:
        messages = list(client.generate_stream("hello, null", max_tokens=5, stream_interval=1, timeout=60))
        whole = client.generate("hello, null", max_tokens=5, timeout=60)
    with redis.Redis.from_url(cluster.redis_url) as r:  # written a token at a time
        entries = [f for _, f in r.xrange(f"pdq:req:{messages[0].request_id}:out") if b"i" in f]
    assert [f[b"t"] for f in entries] == [str(t).encode() for t in whole.token_ids]
    assert streamed(messages) == (list(range(5)), whole.token_ids)
    assert whole.prompt_tokens > 0 and whole.text
