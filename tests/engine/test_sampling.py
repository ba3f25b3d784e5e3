"""SamplingParams validation and the sampler's contract: greedy, filters, seeded reproducibility."""

import pytest
import torch

from pdq.engine import SamplingParams, sample

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
        ({"seed": "7"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"),
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
