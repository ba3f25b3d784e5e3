"""Loading a local HF checkpoint's config and weights without transformers' modeling code.

transformers resolves a config.json into a full config (every family default applied, rope
settings standardized), and its model classes load the weights; importing the config and model
classes alone costs seconds of a worker's start-up (they pull in much of transformers and
torch.distributed). pdq needs neither the classes nor their modules: `ModelSpec` and the rope
tables read plain attributes, and the layers read tensors by name.

So `load_checkpoint(path)` reads the weights straight from the checkpoint's safetensors files,
and the config as transformers resolved it, kept once per config.json content and transformers
version in ``$PDQ_CACHE_DIR/configs`` (the first load of a checkpoint resolves it with
`AutoConfig` and writes the cache; every later one reads a JSON file). The cache only holds what
transformers computed: nothing is guessed. It returns None, and the caller loads through
transformers as before, where this path does not apply: a rope type other than the default (its
tables come from transformers' own functions, which take a config object), weights not in
safetensors, or names other than the standard ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from pdq.model.arch import FUSED_PROJECTIONS, SUPPORTED_MODEL_TYPES, ModelSpec, rope_params
from pdq.model.builtin import default_cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdq.model")

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """What `ModelRunner` takes in place of an HF model: `config` (the resolved config as
    attributes) and `state_dict()` (the checkpoint's tensors by name, in their stored dtype)."""

    def __init__(self, config: SimpleNamespace, tensors: dict[str, torch.Tensor]):
        self.config = config
        self._tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._tensors


def _weight_files(path: Path) -> list[Path] | None:
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    if (path / INDEX).is_file():
        names = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        return [path / n for n in names]
    return None


def _cache_file(path: Path) -> Path:
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = "none"
    digest = hashlib.sha256((path / "config.json").read_bytes() + version.encode()).hexdigest()[:24]
    return default_cache_dir() / "configs" / f"{digest}.json"


def resolved_config(path: str | Path) -> Any:
    """config.json of `path` as transformers resolves it (`AutoConfig.from_pretrained(path)
    .to_dict()`), as attributes; from the cache when this checkpoint's config was resolved
    before by the same transformers version. A model type pdq does not run comes back as
    transformers' config object (`ModelSpec.from_hf_config` names what it lacks)."""
    path = Path(path)
    cached = _cache_file(path)
    try:
        full = json.loads(cached.read_text())
        if full.get("model_type") in SUPPORTED_MODEL_TYPES:
            return SimpleNamespace(**full)
    except (OSError, ValueError):
        pass
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:  # its attribute aliases live in its class: kept as is
        return config
    text = json.dumps(config.to_dict())
    full = json.loads(text)  # as the cache gives it back (e.g. id2label's keys become strings)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, cached)  # concurrent loaders write the same content; the last rename wins
    except OSError as exc:  # a read-only cache: resolved again next time
        log.debug("could not cache the resolved config of %s: %s", path, exc)
    return SimpleNamespace(**full)


def required_weights(spec: ModelSpec) -> list[str]:
    """The tensor names the runtime's layers read from a checkpoint of `spec`."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if spec.model_type in FUSED_PROJECTIONS:  # as stored: q/k/v in one tensor, gate/up in another
            names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight", p + "mlp.gate_up_proj.weight",
                      p + "mlp.down_proj.weight"]
            continue
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.append(f"{p}self_attn.{proj}.weight")
            if (spec.o_bias if proj == "o_proj" else spec.qkv_bias):
                names.append(f"{p}self_attn.{proj}.bias")
        if spec.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}mlp.{proj}.weight")
            if spec.mlp_bias:
                names.append(f"{p}mlp.{proj}.bias")
    return names


def load_checkpoint(path: str | Path, config: Any = None) -> Checkpoint | None:
    """The checkpoint at `path` without transformers' model classes, or None where it needs
    them (see the module's docstring); `config`: its `resolved_config`, if the caller has it.
    Raises `UnsupportedModelError` for an unsupported config."""
    path = Path(path)
    files = _weight_files(path)
    if files is None:
        return None
    config = config if config is not None else resolved_config(path)
    spec = ModelSpec.from_hf_config(config)
    if rope_params(config).get("rope_type", "default") != "default":
        return None
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(file))
    missing = [n for n in required_weights(spec) if n not in tensors]
    if missing:
        log.info("%s: %d tensors not under their usual names (e.g. %s); loading through transformers",
                 path, len(missing), missing[0])
        return None
    return Checkpoint(config, tensors)
