"""Which checkpoints the runtime runs: the architecture facts read and checked from an HF config.

Llama, Mistral, Qwen2 and Qwen3 are one decoder shape (pre-norm attention with rotary and a
SwiGLU MLP) that differs in a few switches: biases on the q/k/v and output projections, an
RMSNorm on each query and key head (Qwen3), and a sliding attention window (Mistral, Qwen with
`use_sliding_window`). `ModelSpec` holds those switches; anything else is refused up front with
`UnsupportedModelError` naming every feature that is missing. No torch here: the gateway and
the CLI check a checkpoint without loading the model.
"""

from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
FUSED_PROJECTIONS = ("phi3",)  # checkpoints that store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or config uses a feature this runtime does not implement."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the runtime needs.

    qkv_bias / o_bias: the attention projections carry biases (Llama's `attention_bias` sets
    both; Qwen2 biases q/k/v only). qk_norm: RMSNorm over each query and key head before rotary
    (Qwen3). sliding_window: the shortest attention window of any layer, None when every layer
    attends to the whole sequence; the runtime runs such a model only up to that many positions.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        """Raises UnsupportedModelError naming every unsupported feature of `config`."""
        problems = []
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(f"model_type={model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act={act!r} (only 'silu')")
        rope_type = rope_params(config).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(f"rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        partial = rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            problems.append(f"partial_rotary_factor={partial} (only 1.0: rotary over whole heads)")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            problems.append(f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}")
        if problems:
            raise UnsupportedModelError("unsupported model config: " + "; ".join(problems))
        eos = getattr(config, "eos_token_id", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=_sliding_window(config, model_type),
            eos_token_ids=eos,
        )

    def check_max_seq_len(self, max_seq_len: int) -> None:
        """Raises ValueError when this model cannot run sequences of `max_seq_len` positions."""
        if max_seq_len > self.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's "
                             f"max_position_embeddings={self.max_position_embeddings}")
        if self.sliding_window is not None and max_seq_len > self.sliding_window:
            raise UnsupportedModelError(
                f"sliding_window={self.sliding_window}: attention over a sliding window is not supported, so this "
                f"model runs sequences of at most {self.sliding_window} positions (max_seq_len={max_seq_len}); "
                f"set --max-seq-len {self.sliding_window} or less")


def _sliding_window(config, model_type: str) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if model_type != "mistral" and layer_types is not None and "sliding_attention" not in layer_types:
        return None  # Qwen: a window is configured but no layer uses it
    return int(window)


def rope_params(config) -> dict:
    """RoPE settings from a transformers 5 (`rope_parameters`) or 4.x (`rope_scaling`) config."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params["type"]
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params
