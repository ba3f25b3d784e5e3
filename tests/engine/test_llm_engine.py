"""LLMEngine end to end: continuous batching gives the same greedy tokens as HF alone."""

import pytest
import torch

from pdq.engine import LLMEngine, SamplingParams

PROMPT_LENS = [3, 40, 75, 1, 17, 60, 9]
MAX_TOKENS = [12, 5, 20, 8, 15, 3, 25]


def prompts(lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def small_engine(runner) -> LLMEngine:
    # room for 3 max_seq_len sequences, 7 come: the 75-token prompt takes 3 chunks of <= 32
    return LLMEngine(runner, max_batched_tokens=48, prefill_chunk=32)


def test_greedy_matches_hf_alone(tiny_llama, make_runner, hf_greedy):
    runner = make_runner(tiny_llama, slots=3)
    engine = small_engine(runner)
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outs = engine.generate(ps, params)
    assert outs == [hf_greedy(tiny_llama, p, n) for p, n in zip(ps, MAX_TOKENS)]
    assert runner.free_tokens == runner.capacity_tokens  # no leak
    assert runner.usage().tokens_cached == 0


def test_eos_stops_like_hf(tiny_llama, make_runner, hf_greedy):
    ps = prompts()
    free_run = hf_greedy(tiny_llama, ps[0], 12)
    eos = free_run[4]  # a token greedy decoding does produce
    expected = [hf_greedy(tiny_llama, p, n, eos_token_id=eos) for p, n in zip(ps, MAX_TOKENS)]
    assert len(expected[0]) <= 5 and expected[0][-1] == eos

    engine = small_engine(make_runner(tiny_llama, slots=3))
    results = engine.generate_completions(ps, [SamplingParams(max_tokens=n, temperature=0) for n in MAX_TOKENS], eos)
    assert [c.token_ids for c in results] == expected
    for c, n in zip(results, MAX_TOKENS):
        assert c.finish_reason == ("eos" if c.token_ids[-1] == eos and len(c.token_ids) <= n else "length")
        assert c.finish_reason == "length" or eos not in c.token_ids[:-1]
    ignored = engine.generate(ps[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), eos)
    assert ignored == [free_run]


def test_seeded_sampling_independent_of_batch(tiny_llama, make_runner):
    ps = prompts()
    params = [SamplingParams(max_tokens=n, temperature=0.8, top_k=40, seed=i) for i, n in enumerate(MAX_TOKENS)]
    batched = small_engine(make_runner(tiny_llama, slots=3)).generate(ps, params)
    engine = LLMEngine(make_runner(tiny_llama, slots=1), max_batched_tokens=16, prefill_chunk=8)
    alone = [engine.generate([p], sp)[0] for p, sp in zip(ps, params)]
    assert batched == alone
    assert len({tuple(o) for o in batched}) == len(batched)


def test_request_validation(tiny_llama, make_runner):
    engine = LLMEngine(make_runner(tiny_llama, slots=1, max_seq_len=32))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_request(list(range(30)), SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.add_request([256], SamplingParams())
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])


def test_abort_frees_kv_and_leaves_others_intact(tiny_llama, make_runner, hf_greedy):
    runner = make_runner(tiny_llama, slots=2)
    engine = small_engine(runner)
    ps = prompts()[:4]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in ps]
    engine.step()
    assert engine.abort_request(ids[0]) and engine.abort_request(ids[3])  # one running, one waiting
    assert not engine.abort_request(ids[3])
    done = {}
    while engine.has_unfinished():
        done.update({c.seq_id: c.token_ids for c in engine.step()})
    assert sorted(done) == ids[1:3]
    assert [done[i] for i in ids[1:3]] == [hf_greedy(tiny_llama, p, 6) for p in ps[1:3]]
    assert runner.free_tokens == runner.capacity_tokens


def test_a_cached_prefix_is_skipped_and_changes_no_token(tiny_llama, make_runner, hf_greedy):
    system = prompts([64], seed=3)[0]  # four blocks of 16
    ps = [system + p for p in prompts([5, 9, 3, 12], seed=4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runner = make_runner(tiny_llama, slots=4)
    engine = LLMEngine(runner, max_batched_tokens=256, prefill_chunk=64)
    outs = engine.generate(ps[:1], params) + engine.generate(ps[1:], params)
    assert outs == [hf_greedy(tiny_llama, p, 8) for p in ps]
    assert runner.pool.blocks.hit_tokens == 3 * 64  # every later prompt found the system prompt
    off = make_runner(tiny_llama, slots=4, prefix_cache=False)
    assert LLMEngine(off, max_batched_tokens=256, prefill_chunk=64).generate(ps, params) == outs
    assert off.pool.blocks.hit_tokens == 0


def test_preemption_by_recompute_when_blocks_run_out_changes_no_token(tiny_llama, make_runner, hf_greedy):
    runner = make_runner(tiny_llama, slots=1)  # 128 positions: 8 blocks, for 4 sequences growing to 60
    engine = LLMEngine(runner, max_batched_tokens=64, prefill_chunk=32)
    ps = prompts([30, 25, 40, 20], seed=5)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert engine.generate(ps, params) == [hf_greedy(tiny_llama, p, 30) for p in ps]
    assert engine.preemptions > 0
    assert runner.free_tokens == runner.capacity_tokens
