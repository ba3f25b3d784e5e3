"""The null model (`--model null`, `null:STEP_MS`): tokens at a chosen rate and no compute, for
measuring the serving path (gateway, scheduler, Redis, workers, hand-offs) without a model.

A null checkpoint dir holds a config.json of the Llama shape with the smallest KV there is (one
layer, one KV head, head dim 2, so a hand-off carries 16 bytes per position) plus
``pdq_null_step_ms``, the built-in byte-level tokenizer, and no weights. `ModelRunner` runs it
through `pdq.model.null_forward.NullForward`: the same step rows, block tables and KV pool as any
model, but the forward pass only picks each row's next token with :func:`next_token` (a function
of the row's token and position, never an EOS, so a request ends by ``max_tokens`` or a stop
string), writes no K/V, and sleeps ``step_ms`` first. Greedy output is therefore known in advance
and the same on every path (colocated, P/D, resumed after a requeue).

No torch here: the gateway resolves ``null`` to its dir and reads its tokenizer like any model's.
"""

from __future__ import annotations

import json
from pathlib import Path

NULL = "null"
NULL_VERSION = "v1"  # bump when the files written below change
STEP_MS_KEY = "pdq_null_step_ms"
FIRST_TOKEN = 3  # ids 0..2 are the tokenizer's bos/eos/pad: never emitted


def is_null_spec(spec: str) -> bool:
    return spec == NULL or spec.startswith(NULL + ":")


def parse_step_ms(spec: str) -> float:
    """``"null"`` -> 0.0; ``"null:STEP_MS"`` -> STEP_MS, the milliseconds each forward pass
    sleeps (a running sequence then gets at most 1000 / STEP_MS tokens/s). ValueError otherwise."""
    text = spec.partition(":")[2]
    if not text:
        return 0.0
    try:
        step_ms = float(text)
    except ValueError:
        step_ms = -1.0
    if not 0.0 <= step_ms < 60_000.0:
        raise ValueError(f"model {spec!r}: null:STEP_MS takes milliseconds per forward pass, 0 <= STEP_MS < 60000")
    return step_ms


def next_token(token: int, position: int, vocab_size: int) -> int:
    """The null model's greedy choice after `token` at `position`: never below FIRST_TOKEN."""
    return FIRST_TOKEN + (token * 31 + position * 17) % (vocab_size - FIRST_TOKEN)


def greedy_output(prompt: list[int], max_tokens: int, vocab_size: int) -> list[int]:
    """What a null model generates for `prompt` (at least one token) with greedy sampling."""
    out, token, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(max_tokens):
        token = next_token(token, pos, vocab_size)
        out.append(token)
        pos += 1
    return out


def null_config(step_ms: float, vocab_size: int) -> dict:
    """config.json of a null checkpoint: a Llama shape `pdq.model.arch` accepts, with the
    least KV per position, and positions up to 2**20 (the workers' --max-seq-len caps them)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 2, "intermediate_size": 2, "num_hidden_layers": 1, "num_attention_heads": 1,
        "num_key_value_heads": 1, "head_dim": 2, "hidden_act": "silu", "max_position_embeddings": 1 << 20,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "pad_token_id": 2, STEP_MS_KEY: step_ms,
    }


def null_dir(step_ms: float, cache_dir: Path | None = None) -> Path:
    from pdq.model.builtin import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "models" / f"null-{step_ms:g}ms-{NULL_VERSION}"


def ensure_null(spec: str, cache_dir: Path | None = None) -> Path:
    """The cached null checkpoint dir of `spec` (``null`` or ``null:STEP_MS``), written on first
    use (the tokenizer is the built-in one, trained in ~1 s)."""
    from pdq.model.builtin import VOCAB_SIZE, build_once, build_tokenizer

    step_ms = parse_step_ms(spec)

    def write(tmp: Path) -> None:
        build_tokenizer().save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(null_config(step_ms, VOCAB_SIZE), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1,
                                                                "pad_token_id": 2, "do_sample": False}))

    return build_once(null_dir(step_ms, cache_dir), write)


def null_step_ms(config) -> float | None:
    """A loaded config's (an HF config or any object with attributes) step in ms if it is a null
    model's, else None."""
    value = getattr(config, STEP_MS_KEY, None)
    return None if value is None else float(value)


class NullCheckpoint:
    """What `ModelRunner` takes in place of an HF model for a null checkpoint dir: its `config`
    (config.json as attributes) and no weights."""

    def __init__(self, path: str | Path):
        from types import SimpleNamespace

        self.config = SimpleNamespace(**json.loads((Path(path) / "config.json").read_text()))

    @staticmethod
    def is_null_dir(path: str | Path) -> bool:
        file = Path(path) / "config.json"
        return file.is_file() and STEP_MS_KEY in json.loads(file.read_text())
