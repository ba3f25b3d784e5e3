"""A checkpoint loads without transformers' model classes: the config as transformers resolved it
(kept once per config.json), the weights straight from safetensors; where that does not apply
(another rope type, weights not in safetensors) it loads through transformers as before."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pdq.engine import LLMEngine, ModelRunner, ModelSpec, SamplingParams
from pdq.engine.llama import rope_inv_freq
from pdq.model.checkpoint import load_checkpoint, required_weights, resolved_config

from .test_families import FAMILIES, save_checkpoint


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDQ_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_checkpoint_loads_the_same_spec_rope_and_tensors_as_transformers_does(tmp_path, family):
    model = save_checkpoint(tmp_path / "ckpt", family)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded is not None
    hf_config = AutoConfig.from_pretrained(tmp_path / "ckpt")
    spec = ModelSpec.from_hf_config(loaded.config)
    assert spec == ModelSpec.from_hf_config(hf_config)
    assert torch.equal(rope_inv_freq(loaded.config, spec)[0], rope_inv_freq(hf_config, spec)[0])
    hf_state = model.state_dict()
    for name in required_weights(spec):
        assert torch.equal(loaded.state_dict()[name], hf_state[name]), name


def test_the_resolved_config_is_read_from_the_cache_without_transformers_after_the_first_load(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "ckpt", "qwen2")  # defaults resolved in code (sliding window, layer types)
    first = resolved_config(tmp_path / "ckpt")
    cached = list((tmp_path / "cache" / "configs").glob("*.json"))
    assert len(cached) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' AutoConfig was asked again")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)
    assert vars(resolved_config(tmp_path / "ckpt")) == vars(first)
    # another config.json (a different checkpoint) is another cache entry: resolved afresh
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(AssertionError, match="asked again"):
        resolved_config(tmp_path / "ckpt")


def test_a_rope_transformers_computes_and_pytorch_bin_weights_load_through_transformers(tmp_path, hf_greedy):
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = save_checkpoint(tmp_path / "rope", "llama", rope_parameters=llama3)
    assert load_checkpoint(tmp_path / "rope") is None
    bin_ = save_checkpoint(tmp_path / "bin", "llama", seed=1)
    torch.save(bin_.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    assert load_checkpoint(tmp_path / "bin") is None
    prompt = [5, 9, 200, 31]
    for name, hf in (("rope", rope), ("bin", bin_)):
        runner = ModelRunner.from_pretrained(str(tmp_path / name), kv_budget_tokens=256, max_seq_len=128, device="cpu")
        out = LLMEngine(runner).generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert out == [hf_greedy(hf, prompt, 6)], name
