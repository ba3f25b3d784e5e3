"""Every supported family (Llama, Mistral, Qwen2, Qwen3, Phi-3): a small random-weight checkpoint built
with `transformers`, saved, loaded as a worker loads it, decodes greedily token for token as its
own `generate()` does; a checkpoint of anything else is refused with what it lacks."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                          Qwen3Config)

from pdq.engine import LLMEngine, ModelRunner, ModelSpec, SamplingParams, UnsupportedModelError

from .conftest import TINY

FAMILIES = {
    "llama": (LlamaConfig, {"attention_bias": True}),
    "mistral": (MistralConfig, {"sliding_window": 4096}),
    "qwen2": (Qwen2Config, {}),  # biased q/k/v, unbiased output projection
    "qwen3": (Qwen3Config, {"head_dim": 24}),  # q/k head norms; head_dim != hidden / heads
    "phi3": (Phi3Config, {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),  # q/k/v and gate/up stored fused
}
PROMPTS = [[5, 9, 200, 31, 7], list(range(40, 77)), [3] * 12]
MAX_TOKENS = [14, 9, 20]


def save_checkpoint(path, family: str, seed: int = 0, **overrides):
    """A tiny random checkpoint of `family` in `path`: biases and head norms randomized too, so
    reading any of them wrong changes the output."""
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**{**TINY, **extra, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "_norm" in name:
                p.normal_(0.5 if "_norm" in name else 0.0, 0.2)
    model.eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_matches_the_familys_own_generate(tmp_path, family, hf_greedy):
    model = save_checkpoint(tmp_path, family)
    assert type(model).__name__.lower().startswith(family)
    runner = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=4 * 128, max_seq_len=128, device="cpu")
    assert runner.spec.model_type == family
    engine = LLMEngine(runner, max_batched_tokens=48, prefill_chunk=16)  # chunked prefill, batched decode
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    outs = engine.generate(PROMPTS, params)
    assert outs == [hf_greedy(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("family, switches", [
    ("llama", dict(qkv_bias=True, o_bias=True, qk_norm=False, sliding_window=None)),
    ("mistral", dict(qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=4096)),
    ("qwen2", dict(qkv_bias=True, o_bias=False, qk_norm=False, sliding_window=None)),
    ("qwen3", dict(qkv_bias=False, o_bias=False, qk_norm=True, sliding_window=None)),
    ("phi3", dict(qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=None)),
])
def test_each_family_reads_its_switches(family, switches):
    config_cls, extra = FAMILIES[family]
    spec = ModelSpec.from_hf_config(config_cls(**{**TINY, **extra}))
    assert {k: getattr(spec, k) for k in switches} == switches


def test_a_sliding_window_shorter_than_max_seq_len_is_refused_with_the_fix(tmp_path):
    save_checkpoint(tmp_path, "qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    with pytest.raises(UnsupportedModelError, match="sliding_window=64.*--max-seq-len 64 or less"):
        ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=256, max_seq_len=128, device="cpu")
    runner = ModelRunner.from_pretrained(str(tmp_path), kv_budget_tokens=256, max_seq_len=64, device="cpu")
    assert runner.spec.sliding_window == 64


def test_a_configured_window_that_no_layer_uses_is_no_window():
    spec = ModelSpec.from_hf_config(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=64,
                                                max_window_layers=TINY["num_hidden_layers"]))
    assert spec.sliding_window is None


def test_every_unsupported_feature_is_named_at_once():
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2' .supported: llama, mistral, qwen2, qwen3, phi3"):
        ModelSpec.from_hf_config(GPT2Config())
    dynamic_rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'.*rope type 'dynamic'"):
        ModelSpec.from_hf_config(LlamaConfig(**{**TINY, "hidden_act": "gelu", "rope_parameters": dynamic_rope}))
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5 .only 1.0"):
        ModelSpec.from_hf_config(Phi3Config(**{**TINY, **FAMILIES["phi3"][1], "rope_parameters": partial}))


def test_a_worker_given_an_unsupported_checkpoint_exits_1_with_one_line(tmp_path, redis_server):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"
    out = subprocess.run([sys.executable, "-m", "pdq.cli", "decode", "--port", "0", "--metrics-port", "-1",
                          "--redis-url", redis_server.url, "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "cannot run the model" in line]
    assert len(lines) == 1 and "model_type='gpt2'" in lines[0], out.stderr
