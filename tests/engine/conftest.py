"""Factories for tiny seeded random Llama models and runners (float32, CPU)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pdq.engine import ModelRunner

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=5000.0,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def make_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random tiny Llama (GQA 4 q heads / 2 kv heads by default), eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    return make_llama()


@pytest.fixture
def make_runner():
    def make(model, slots: int = 4, max_seq_len: int = 128, **kw) -> ModelRunner:
        return ModelRunner(model, kv_budget_tokens=slots * max_seq_len, max_seq_len=max_seq_len, device="cpu", **kw)

    return make


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """HF reference: the prompt alone, greedy. With eos_token_id None it never stops early."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def hf_greedy():
    return _hf_greedy


@pytest.fixture(name="make_llama")
def make_llama_fixture():
    return make_llama
