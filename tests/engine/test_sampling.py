"""SamplingParams validation and the sampler's contract: greedy, filters, seeded reproducibility."""

import pytest
import torch

from pdq.engine import SamplingParams, sample
from pdq.engine.sampling import sample_each

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_normalize_stop():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop="x").stop == ("x",)
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # frozen


def test_greedy_and_top_k_1_are_argmax():
    x = logits(6)
    argmax = x.argmax(-1).tolist()
    assert sample(x, [SamplingParams(temperature=0)] * 6, [0] * 6) == argmax
    assert sample(x, [SamplingParams(temperature=1.5, top_k=1)] * 6, [0] * 6) == argmax
    assert sample(x, [SamplingParams(temperature=1.0, top_p=1e-6)] * 6, [0] * 6) == argmax
    assert sample(x, [SamplingParams(temperature=1e-4, seed=1)] * 6, [0] * 6) == argmax


def test_seeded_tokens_do_not_depend_on_batch():
    x = logits(8, seed=3)
    params = [SamplingParams(temperature=1.0, seed=100 + i, top_k=20, top_p=0.9) for i in range(8)]
    steps = list(range(8))
    batched = sample(x, params, steps)
    alone = [sample(x[i : i + 1], [params[i]], [steps[i]])[0] for i in range(8)]
    assert batched == alone
    mixed = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=2.0)] * 2  # other rows
    for i in range(8):
        rows = torch.cat([x[:3], x[i : i + 1], x[:2]])
        assert sample(rows, mixed[:3] + [params[i]] + mixed[3:], [0, 0, 0, steps[i], 5, 5])[3] == batched[i]


def test_seed_and_step_both_matter():
    x = logits(1, seed=4)
    same = {sample(x, [SamplingParams(seed=1, temperature=5.0)], [0])[0] for _ in range(5)}
    assert len(same) == 1  # same (seed, step): same token
    by_step = {sample(x, [SamplingParams(seed=1, temperature=5.0)], [s])[0] for s in range(30)}
    by_seed = {sample(x, [SamplingParams(seed=s, temperature=5.0)], [0])[0] for s in range(30)}
    assert len(by_step) > 5 and len(by_seed) > 5


def test_top_k_and_top_p_restrict_support():
    x = logits(1, seed=5)
    n = 400
    rows = x.expand(n, V)
    top5 = set(x[0].topk(5).indices.tolist())
    got = sample(rows, [SamplingParams(temperature=3.0, top_k=5)] * n, list(range(n)))
    assert set(got) <= top5 and len(set(got)) > 1
    probs = x[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    got = sample(rows, [SamplingParams(temperature=1.0, top_p=0.5)] * n, list(range(n)))
    assert set(got) <= nucleus


def test_temperature_matches_distribution():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    for temp in (0.5, 2.0):
        got = torch.tensor(sample(x.expand(n, 4), [SamplingParams(temperature=temp, seed=7)] * n, list(range(n))))
        freq = torch.bincount(got, minlength=4).float() / n
        torch.testing.assert_close(freq, (x[0] / temp).softmax(-1), atol=0.03, rtol=0)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1])
def test_every_uint64_seed_samples_reproducibly_however_batched(seed):
    x = logits(6, seed=8)
    params = [SamplingParams(temperature=1.5, seed=seed)] * 6
    steps = list(range(6))
    batched = sample(x, params, steps)
    assert batched == sample(x, params, steps)
    assert batched == [sample(x[i:i + 1], [params[i]], [i])[0] for i in range(6)]
    others = [SamplingParams(temperature=0.7, seed=seed ^ 1), SamplingParams(temperature=0)]
    assert sample(torch.cat([x[:2], x[3:4]]), others + [params[3]], [3, 0, 3])[2] == batched[3]


def test_seeds_past_2_63_are_not_folded_onto_those_below():
    x = logits(1, seed=9).expand(40, V)
    low = sample(x, [SamplingParams(temperature=5.0, seed=7)] * 40, list(range(40)))
    high = sample(x, [SamplingParams(temperature=5.0, seed=7 + 2**63)] * 40, list(range(40)))
    assert low != high


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 1e-30, 1e-6])
def test_a_tiny_temperature_matches_greedy_and_never_gives_nan(temperature):
    x = logits(8, seed=10) * 50  # large logits: x / t overflows to inf without the max subtracted first
    greedy = x.argmax(-1).tolist()
    for extra in ({}, {"seed": 3}, {"top_k": 5}, {"top_p": 0.5}):
        assert sample(x, [SamplingParams(temperature=temperature, **extra)] * 8, list(range(8))) == greedy


def test_a_row_that_cannot_be_sampled_fails_alone():
    x = logits(4, seed=11)
    good = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0), SamplingParams(temperature=2.0, seed=6)]
    poisoned = SamplingParams(temperature=1.0)
    object.__setattr__(poisoned, "temperature", "hot")  # past validation: sampling this row raises
    got = sample_each(x, [good[0], poisoned, good[1], good[2]], [0, 0, 0, 1])
    assert isinstance(got[1], Exception)
    assert [got[0], got[2], got[3]] == sample(x[[0, 2, 3]], good, [0, 0, 1])
    assert sample_each(x, [good[0]] * 4, [0] * 4) == sample(x, [good[0]] * 4, [0] * 4)


def test_a_logit_bias_moves_greedy_too():
    x = logits(2)
    weakest = int(x[0].argmin())
    out = sample(x, [SamplingParams(temperature=0, logit_bias={weakest: 100}), SamplingParams(temperature=0)],
                 [0, 0])
    assert out == [weakest, int(x[1].argmax())]  # the other row untouched


def test_repetition_penalty_divides_a_seen_positive_logit_and_multiplies_a_negative_one():
    x = torch.zeros(1, V)
    x[0, 7], x[0, 8], x[0, 9] = 4.0, 3.0, -1.0
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(x, [p], [0], [((7,), ())]) == [8]  # 4 / 2 = 2 < 3
    assert sample(x, [p], [0], [((), (8, 7))]) == [7]  # both seen: 2 vs 1.5
    assert sample(x, [SamplingParams(temperature=0)], [0], [((7,), ())]) == [7]  # off: unchanged
    from pdq.engine.sampling import _process
    got = _process(x, [p], [0], [((9,), ())], None)
    assert got[0, 9] == -2.0 and got[0, 7] == 4.0


def test_presence_and_frequency_penalties_count_the_output_only():
    x = torch.zeros(1, V)
    x[0, 5], x[0, 6] = 3.0, 2.5
    assert sample(x, [SamplingParams(temperature=0, presence_penalty=1.0)], [0], [((5, 5), ())]) == [5]
    assert sample(x, [SamplingParams(temperature=0, presence_penalty=1.0)], [0], [((), (5,))]) == [6]
    assert sample(x, [SamplingParams(temperature=0, frequency_penalty=0.3)], [0], [((), (5,))]) == [5]  # 2.7
    assert sample(x, [SamplingParams(temperature=0, frequency_penalty=0.3)], [0], [((), (5, 5))]) == [6]  # 2.4


def test_a_row_with_penalties_but_no_history_fails_alone():
    out = sample_each(logits(2), [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)],
                      [0, 0])
    assert isinstance(out[0], ValueError) and out[1] == int(logits(2)[1].argmax())


def test_min_p_keeps_only_tokens_near_the_top():
    x = torch.zeros(4, V)
    x[:, 11], x[:, 12] = 10.0, 9.9  # two near the top; the rest far below
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    drawn = {t for i in range(200) for t in sample(x[:1], [SamplingParams(temperature=1.0, min_p=0.5, seed=i)], [0])}
    assert drawn == {11, 12}
    assert sample(x[:1], [SamplingParams(temperature=1.0, min_p=1.0, seed=5)], [0]) == [11]
    assert p.min_p == 0.5


def test_a_stop_token_id_ends_the_output_even_with_ignore_eos():
    p = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert p.finish(7, {1}) == "eos" and p.finish(1, {1}) == "" and p.finish(3, {1}) == ""
    assert SamplingParams().finish(1, {1}) == "eos"


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_reached():
    x = torch.zeros(1, V)
    x[0, 3], x[0, 7], x[0, 9] = 10.0, 9.0, 8.0  # EOS (3) on top, then a stop token id (7)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    assert [sample(x, [p], [step], None, [{3}]) for step in (0, 1, 2)] == [[9], [9], [3]]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)  # EOS ends nothing: not held back
    assert sample(x, [ignoring], [0], None, [{3}]) == [3]
    seeded = SamplingParams(temperature=1.0, seed=4, min_tokens=1, stop_token_ids=[7])
    assert all(sample(x, [SamplingParams(temperature=1.0, seed=s, min_tokens=1)], [0], None, [{3}]) != [3]
               for s in range(50))
    assert sample(x.repeat(2, 1), [seeded, p], [0, 5], None, [{3}, {3}])[1] == 3  # rows keep their own steps
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_the_end_reason_of_a_step():
    from pdq.engine.sequence import end_reason

    p = SamplingParams(max_tokens=4, stop_token_ids=[9])
    assert end_reason(p, 5, {2}, 1, 10, 100) == ""
    assert end_reason(p, 2, {2}, 1, 10, 100) == "eos" and end_reason(p, 9, {2}, 1, 10, 100) == "eos"
    assert end_reason(p, 5, {2}, 4, 13, 100) == "length"  # max_tokens
    assert end_reason(p, 5, {2}, 2, 99, 100) == "length"  # the context is full
    assert end_reason(p, 2, {2}, 4, 13, 100, stopped=True) == "stop"  # a stop string first
    assert end_reason(p, 5, {2}, 4, 13, 100, complete=True) == "stop"  # the grammar's end before length
    assert end_reason(SamplingParams(max_tokens=4, ignore_eos=True), 2, {2}, 1, 10, 100) == ""


def test_argmax_rows_is_torchs_argmax_ties_nans_and_views_included():
    """The sampler's argmax (numpy's on CPU: torch's CPU argmax is many times slower over a
    vocabulary) picks exactly what torch's would: the first of tied maxima, the first NaN, index
    0 of an all -inf row, on views as well as on whole tensors."""
    from pdq.engine.sampling import argmax_rows

    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 4096, generator=g)
    x[0, 9] = x[0, 3000] = x[0].max() + 1  # a tie: the first wins
    x[1, 17] = x[1, 5] = float("nan")
    x[2] = float("-inf")
    x[3, :] = 0.5
    for t in (x, x[:, 100:900], x[::2], x.double(), x.bfloat16(), x.half()):  # 16-bit: a bfloat16 model's logits
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))
    assert argmax_rows(x)[:4].tolist() == [9, 5, 0, 0]
