"""Workloads are seeded and have exact lengths; arrivals are seeded and well formed."""

import math
import statistics

import pytest

from pdq.bench.arrivals import Arrivals, parse_concurrency, parse_rates
from pdq.bench.roofline import decode_steps, passes
from pdq.bench.workload import RESERVED_IDS, SHARED_PREFIX_TOKENS, WORKLOADS, build, for_repeat, vocabulary
from pdq.model.loader import resolve_model

VOCAB = range(3, 4096)


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_other_seed_other_requests(name):
    a, b, c = build(name, VOCAB, seed=1), build(name, VOCAB, seed=1), build(name, VOCAB, seed=2)
    assert a == b
    assert a.requests != c.requests
    assert [r.index for r in a.requests] == list(range(len(a.requests)))


def test_mixed_matches_the_issue():
    w = build("mixed", VOCAB)
    assert len(w.requests) == 32
    assert all(16 <= r.prompt_len <= 256 and 8 <= r.max_tokens <= 128 for r in w.requests)
    assert len({r.prompt_len for r in w.requests}) > 16 and len({r.max_tokens for r in w.requests}) > 16
    assert w.output_tokens == sum(r.max_tokens for r in w.requests)
    assert all(t in VOCAB for r in w.requests for t in r.prompt_token_ids)


def test_uniform_has_one_shape():
    w = build("uniform", VOCAB, n=5)
    assert {(r.prompt_len, r.max_tokens) for r in w.requests} == {(128, 64)}


@pytest.mark.parametrize("max_model_len", [2048, 1024, 512])
def test_long_prompt_has_a_few_long_prompts_that_fit(max_model_len):
    w = build("long-prompt", VOCAB, n=32, max_model_len=max_model_len)
    long = [r for r in w.requests if r.kind == "long"]
    assert len(long) == 4 and {r.kind for r in w.requests} == {"long", "short"}
    assert all(r.prompt_len > max_model_len - 256 for r in long)
    assert all(r.prompt_len + r.max_tokens <= max_model_len and r.max_tokens >= 1 for r in w.requests)


@pytest.mark.parametrize("max_model_len", [2048, 512])
def test_shared_prefix_requests_open_with_one_long_system_prompt_then_their_own_part(max_model_len):
    w = build("shared-prefix", VOCAB, n=32, max_model_len=max_model_len)
    shared = min(SHARED_PREFIX_TOKENS, max_model_len - 256)
    system = w.requests[0].prompt_token_ids[:shared]
    assert all(r.prompt_token_ids[:shared] == system for r in w.requests)
    own = {r.prompt_token_ids[shared:] for r in w.requests}
    assert len(own) == 32 and all(16 <= len(o) <= 96 for o in own)  # every request's own part differs
    assert all(r.prompt_len + r.max_tokens <= max_model_len and r.max_tokens >= 1 for r in w.requests)


def test_each_repeat_offers_fresh_prompts_with_the_same_lengths_and_sharing():
    """A repeat must not find its prompts in a prefix cache that an earlier repeat filled."""
    w = build("shared-prefix", VOCAB, n=8)
    assert for_repeat(w, VOCAB, 0) == w
    r1, r2 = for_repeat(w, VOCAB, 1), for_repeat(w, VOCAB, 2)
    for other in (r1, r2):
        assert [(r.prompt_len, r.max_tokens, r.kind) for r in other.requests] == \
               [(r.prompt_len, r.max_tokens, r.kind) for r in w.requests]
        assert all(t in VOCAB for r in other.requests for t in r.prompt_token_ids)
        shared = other.requests[0].prompt_token_ids[:SHARED_PREFIX_TOKENS]
        assert all(r.prompt_token_ids[:SHARED_PREFIX_TOKENS] == shared for r in other.requests)
    firsts = {x.requests[0].prompt_token_ids[:16] for x in (w, r1, r2)}
    assert len(firsts) == 3  # no leading block in common across repeats


def test_the_roofline_runs_every_prompt_row_and_every_decode_row_once():
    w = build("mixed", VOCAB)
    shapes = passes(w, step_tokens=1024)
    rows = sum(r * n for (r, _), n in shapes.items())
    assert rows == w.prompt_tokens + sum(r.max_tokens - 1 for r in w.requests)
    sampled = sum(s * n for (_, s), n in shapes.items())
    assert sampled == w.output_tokens  # a row samples once per output token
    steps = decode_steps(w)
    assert len(steps) == max(r.max_tokens for r in w.requests) - 1
    assert steps[0] == (sum(r.max_tokens > 1 for r in w.requests),
                        sum(r.prompt_len + 1 for r in w.requests if r.max_tokens > 1))  # each row's own context
    assert all(a[0] >= b[0] for a, b in zip(steps, steps[1:]))  # sequences only leave


def test_multi_tenant_tenants_have_rates_and_weights():
    w = build("multi-tenant", VOCAB, n=300)
    shares = {t.name: t.rate_share for t in w.tenants}
    counts = {t: sum(r.tenant == t for r in w.requests) for t in shares}
    assert counts["flood"] > 2 * counts["steady"] and counts["steady"] > 0 and counts["premium"] > 0
    assert {t.name: t.weight for t in w.tenants}["premium"] == 2.0


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope", VOCAB)
    with pytest.raises(ValueError, match=">= 1"):
        build("mixed", VOCAB, n=0)


def test_builtin_vocabulary_has_no_special_ids():
    vocab = vocabulary(resolve_model("builtin:tiny"))
    assert not RESERVED_IDS & set(vocab)
    assert min(vocab) == 3 and max(vocab) == 4095


def test_arrivals():
    assert Arrivals().offsets(3) == [0.0, 0.0, 0.0] and Arrivals().label == "all"
    closed = Arrivals(concurrency=4)
    assert closed.offsets(3) is None and closed.kind == "closed"
    assert closed.offered() == {"arrivals": "closed", "rate_per_s": None, "concurrency": 4}
    poisson = Arrivals(rate=4.0, seed=1)
    t = poisson.offsets(2000)
    assert t == Arrivals(rate=4.0, seed=1).offsets(2000) != Arrivals(rate=4.0, seed=2).offsets(2000)
    assert t[0] == 0 and t == sorted(t)
    assert statistics.mean(b - a for a, b in zip(t, t[1:])) == pytest.approx(0.25, rel=0.1)
    assert poisson.offered() == {"arrivals": "poisson", "rate_per_s": 4.0, "concurrency": None}
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    assert parse_concurrency("1,8") == [1, 8]
    for bad in ("0", "x", "-1"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    with pytest.raises(ValueError):
        parse_concurrency("0")
