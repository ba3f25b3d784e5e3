"""Tier preemption (`--preempt-lower-tiers`): a request of a better tier that finds every decode
seat taken has a running request of a lower tier preempted by recompute. It is served at once; the
preempted request goes back to the queue with the tokens it streamed and resumes after it, its
client seeing every token index once and the same greedy tokens as an uninterrupted run."""

import pytest
import redis

from pdq.client import Client
from pdq.ops.up import Cluster
from tests.e2e.conftest import KEYS
from tests.streams import streamed, until_tokens


@pytest.fixture(scope="module")
def full(auth_file):
    """One decode seat (colocated worker), preemption on."""
    env = {"PDQ_AUTH_FILE": str(auth_file), "PDQ_PREEMPT_LOWER_TIERS": "true", "PDQ_MAX_BATCH_SIZE": "1",
           "PDQ_RESERVE_SLOTS": "0"}
    with Cluster(model="builtin", port=0, auth=False, extra_env=env) as cluster:
        yield cluster


def test_an_interactive_request_preempts_a_running_batch_one_which_resumes_unchanged(full):
    store = redis.Redis.from_url(full.redis_url)
    with Client(full.target, api_key=KEYS["acme"]) as c:
        kw = dict(max_tokens=160, ignore_eos=True, temperature=0.0)
        stream = c.generate_stream("a long batch job", tier="batch", **kw)
        rid = next(stream).request_id
        got = until_tokens(stream, 1)  # it runs: it holds the only seat
        urgent = c.generate("urgent", max_tokens=4, tier="interactive", timeout=60)
        assert urgent.finish_reason == "length" and len(urgent.token_ids) == 4
        assert int(store.hget(f"pdq:req:{rid}", "preempted") or 0) >= 1  # it made room, not the batch job's end
        got += list(stream)
        indices, tokens = streamed(got)
        assert indices == list(range(160))  # every index once, in order, across the preemption
        assert got[-1].finish_reason and got[-1].usage.completion_tokens == 160
        assert tokens == c.generate("a long batch job", tier="batch", **kw).token_ids  # as if never preempted
        assert store.hget(f"pdq:req:{rid}", "state") == b"COMPLETED"
    store.close()
