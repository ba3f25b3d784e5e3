"""A crowd on one gateway (pdq.bench.followers): thousands of concurrent StreamResult followers,
GetResult long-polls and GenerateStreams on a few running requests all end OK with their
request's full token sequence, on a bounded number of Redis connections. `python -m
pdq.bench.followers --calls 10000` runs the 10,000-call version."""

import asyncio

import pytest

from gateway.follower import COLD_READERS, HOT_READERS
from pdq.bench import followers
from pdq.ops.up import Cluster

POOL = 16  # PDQ_REDIS_MAX_CONNECTIONS of every process


@pytest.fixture(scope="module")
def crowded():
    env = {"PDQ_FAULTS": "decode_step_delay_ms=100", "PDQ_REDIS_MAX_CONNECTIONS": str(POOL)}
    with Cluster(model="builtin", port=0, colocate=True, metrics_port=-1, extra_env=env) as cluster:
        yield cluster


def test_2000_concurrent_followers_long_polls_and_streams_end_ok_on_a_bounded_number_of_connections(crowded):
    report = asyncio.run(followers.crowd(crowded.target, crowded.client_key, crowded.redis_url, calls=2000,
                                         requests=4, max_tokens=32, generate_streams=4))
    assert report.errors == {} and report.ok == 2004, report.examples
    assert report.wrong == 0  # every follower of a request got exactly its result, all 32 tokens
    # a few XREADs serve every call (a reader's round per decode step, plus wakes), not one per
    # call per token; a follower that joins late reads what it missed with one XRANGE
    assert report.xread_calls < report.calls / 4, report.xread_calls
    # a connection per follower would be ~2,000; the pools bound them (+ the follower's readers,
    # + the test's two probes), whatever the number of calls
    bound = len(crowded.children) * POOL + COLD_READERS + HOT_READERS + 2
    assert report.connected_clients_max <= bound, (report.connected_clients_max, bound)
    assert crowded.dead_child() is None
