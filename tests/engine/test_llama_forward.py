"""Our Llama forward reproduces HF LlamaForCausalLM logits; unsupported configs fail clearly."""

import pytest
import torch
from pdq.engine import ModelRunner, PrefillItem

from .conftest import TINY

ATOL = 1e-5


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits_all_positions(runner, ids: list[int]) -> torch.Tensor:
    """Logits at every position: prefill the first token, then decode one token at a time."""
    runner.allocate("s")
    rows = [runner.prefill([PrefillItem("s", ids[:1], 0)])[0]]
    for pos in range(1, len(ids)):
        rows.append(runner.decode([("s", ids[pos], pos)])[0])
    runner.free("s")
    return torch.stack(rows)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA: 4 query heads share 2 kv heads
        {"num_key_value_heads": 4},  # plain multi-head
        {"num_key_value_heads": 1, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
        {"rope_theta": 500000.0, "head_dim": 32},  # head_dim != hidden / heads
        {"attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}},
    ],
    ids=["gqa", "mha", "mqa-tied", "head_dim", "bias", "llama3-rope"],
)
def test_logits_match_hf(make_llama, make_runner, overrides):
    model = make_llama(seed=1, **overrides)
    if overrides.get("attention_bias"):  # HF initializes biases to zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    ids = torch.randint(0, TINY["vocab_size"], (50,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(model, ids)
    runner = make_runner(model)

    runner.allocate("p")
    last = runner.prefill([PrefillItem("p", ids, 0)])
    torch.testing.assert_close(last[0], ref[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(our_logits_all_positions(runner, ids), ref, atol=ATOL, rtol=0)


def test_from_pretrained_checkpoint_dir(tmp_path, make_llama):
    model = make_llama(seed=3)
    model.save_pretrained(tmp_path)
    runner = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=256, max_seq_len=128, device="cpu")
    assert (runner.num_layers, runner.num_kv_heads, runner.head_dim) == (2, 2, 16)
    assert (runner.vocab_size, runner.dtype, runner.device.type, runner.max_seq_len) == (256, torch.float32, "cpu", 128)
    ids = list(range(1, 30))
    runner.allocate(0)
    torch.testing.assert_close(runner.prefill([PrefillItem(0, ids)])[0], hf_logits(model, ids)[-1], atol=ATOL, rtol=0)


def test_max_seq_len_beyond_model_positions(make_runner, tiny_llama):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_runner(tiny_llama, max_seq_len=1024)
