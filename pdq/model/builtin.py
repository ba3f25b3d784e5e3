"""The built-in model: a Llama-architecture model with seeded weights and a BPE tokenizer
trained in code, so pdq runs offline on a CPU.

Every process must serve the very same weights and tokenizer, so callers use
:func:`ensure_builtin`, which builds a checkpoint once per cache directory and then only
returns its path. torch and transformers are imported lazily: resolving an already built
checkpoint (e.g. from the gateway, which must not import torch) stays torch-free.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pdq.model.corpus import builtin_corpus

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

BUILTIN_VERSION = "v1"  # bump when anything below changes the built weights or tokenizer
BUILTIN_SEED = 0
VOCAB_SIZE = 4096
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)

BUILTIN_SIZES: dict[str, dict] = {
    "tiny": dict(
        _COMMON,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.1,
    ),
    "small": dict(
        _COMMON,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        initializer_range=0.05,
    ),
    # ~1.1B parameters (TinyLlama's shape): for measuring a GPU, where `small` is launch-bound.
    # Built once per cache dir, 4.4 GB in float32; far too slow to serve on a small CPU.
    "1b": dict(
        _COMMON,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        initializer_range=0.024,
    ),
}


def _check_size(size: str) -> None:
    if size not in BUILTIN_SIZES:
        raise ValueError(f"unknown built-in model size {size!r}; choose one of {sorted(BUILTIN_SIZES)}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train the built-in byte-level BPE tokenizer (deterministic, ~1 s).

    Any unicode string round-trips exactly: ``decode(encode(s)) == s``. Encoding adds no
    special tokens (no BOS): ``encode(text)`` is the plain BPE ids of ``text``. Special tokens
    are ``<s>`` (bos, id 0), ``</s>`` (eos, id 1) and ``<pad>`` (id 2).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(BUILTIN_SEED), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )


def build_model(size: str = "small") -> LlamaForCausalLM:
    """Build the built-in model in float32 with weights drawn from a fixed seed.

    Every linear and embedding weight is N(0, initializer_range) from one seeded generator,
    in ``named_parameters()`` order; norm weights are 1. Same size -> same weights, every time.
    The std is ~1.1/sqrt(hidden): with HF's default 0.02 greedy output soon repeats one
    token; with this one it keeps depending on the whole context and on positions.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    _check_size(size)
    config = LlamaConfig(**BUILTIN_SIZES[size], dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(BUILTIN_SEED)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=gen)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    return model.eval()


def save_builtin(out_dir: str | Path, size: str = "small") -> Path:
    """Write a standard Hugging Face checkpoint (config.json, model.safetensors,
    generation_config.json, tokenizer.json, tokenizer_config.json) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(size).save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def default_cache_dir() -> Path:
    """``$PDQ_CACHE_DIR`` if set, else ``~/.cache/pdq``."""
    return Path(os.environ.get("PDQ_CACHE_DIR") or Path.home() / ".cache" / "pdq")


def builtin_dir(size: str = "small", cache_dir: Path | None = None) -> Path:
    """Where the built-in checkpoint of ``size`` lives (it may not be built yet)."""
    _check_size(size)
    return Path(cache_dir or default_cache_dir()) / "models" / f"builtin-{size}-{BUILTIN_VERSION}"


def ensure_builtin(size: str = "small", cache_dir: Path | None = None) -> Path:
    """Return the cached built-in checkpoint dir of ``size``, building it on first use
    (:func:`build_once`)."""
    return build_once(builtin_dir(size, cache_dir), lambda tmp: save_builtin(tmp, size))


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Return ``target``, a checkpoint dir that ``build(tmp_dir)`` writes, building it on first use.

    Safe under concurrency: builders serialize on an ``fcntl.flock`` lock file, build into a
    temp dir next to the target and ``rename`` it into place, so the target dir either does
    not exist or is complete, and every caller gets the same files.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # built by another process while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
