"""Our own Llama-family forward (Llama, Mistral, Qwen2, Qwen3: `pdq.model.arch`), with weights
taken from a Hugging Face `*ForCausalLM` state dict.

Padding-free: a forward takes the T token rows of one step (prefill chunks and decode tokens
of many sequences, flattened) and reads/writes K/V in the pool through `AttnMetadata`.
Projections are fused at load time (q|k|v, gate|up), as in nano-vllm.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdq.engine.attention import AttnMetadata, attend
from pdq.engine.layers import Linear, RotaryEmbedding, residual_rms_norm, rms_norm, rotary_and_store, silu_and_mul
from pdq.model.arch import FUSED_PROJECTIONS, ModelSpec, rope_params

def rope_inv_freq(config, spec: ModelSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq float32 [head_dim // 2], cos/sin scaling) exactly as HF computes them."""
    params = rope_params(config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = spec.head_dim
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class LlamaLayer(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU MLP, both residual."""

    def __init__(self, spec: ModelSpec, sd: dict[str, torch.Tensor], prefix: str):
        super().__init__()
        a, m = prefix + "self_attn.", prefix + "mlp."

        def fused(names: list[str], bias: bool) -> Linear:  # concatenated along out_features
            w = torch.cat([sd[f"{n}.weight"] for n in names])
            return Linear(w, torch.cat([sd[f"{n}.bias"] for n in names]) if bias else None)

        self.spec = spec
        stored_fused = spec.model_type in FUSED_PROJECTIONS  # (Phi-3: q/k/v and gate/up stored fused, in this order)
        self.qkv = fused([a + "qkv_proj"] if stored_fused else [a + "q_proj", a + "k_proj", a + "v_proj"], spec.qkv_bias)
        self.o = fused([a + "o_proj"], spec.o_bias)
        if spec.qk_norm:  # one RMSNorm over q and k heads together: [q_norm x num_heads | k_norm x kv_heads]
            self.qk_norm = _param(torch.cat([sd[a + "q_norm.weight"].expand(spec.num_heads, -1),
                                             sd[a + "k_norm.weight"].expand(spec.num_kv_heads, -1)]))
        self.gate_up = fused([m + "gate_up_proj"] if stored_fused else [m + "gate_proj", m + "up_proj"], spec.mlp_bias)
        self.down = fused([m + "down_proj"], spec.mlp_bias)
        self.in_norm = _param(sd[prefix + "input_layernorm.weight"])
        self.post_norm = _param(sd[prefix + "post_attention_layernorm.weight"])
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

    def forward(self, x, residual, cos, sin, k_cache, v_cache, meta: AttnMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream `residual` (None
        for the first layer, whose x is the embeddings): the addition is fused with this
        layer's input norm. -> (this layer's output, the residual stream it is to be added to)."""
        s = self.spec
        t = x.shape[0]
        if residual is None:
            residual, normed = x, rms_norm(x, self.in_norm, s.rms_norm_eps)
        else:
            residual, normed = residual_rms_norm(residual, x, self.in_norm, s.rms_norm_eps)
        qkv = self.qkv(normed)
        # rotate q and k heads together: [T, q_heads + kv_heads, head_dim]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, s.head_dim)
        if s.qk_norm:
            qk = rms_norm(qk, self.qk_norm, s.rms_norm_eps)
        v = qkv[:, self.q_size + self.kv_size :].view(t, s.num_kv_heads, s.head_dim)
        qk, stored = rotary_and_store(qk, s.num_heads, cos, sin, v, k_cache, v_cache, meta.kv_rows)
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        o = attend(q, k, v, k_cache, v_cache, meta, stored=stored)
        residual, normed = residual_rms_norm(residual, self.o(o.reshape(t, self.q_size)), self.post_norm,
                                             s.rms_norm_eps)
        return self.down(silu_and_mul(self.gate_up(normed))), residual


class LlamaModel(nn.Module):
    """Llama causal LM over flattened token rows; K/V live in an external pool.

    Build with `from_hf(hf_model_or_state_dict, config, max_positions)`. Projection weights
    are copied (fused); embeddings and norms may alias the given tensors.
    """

    def __init__(self, spec: ModelSpec, sd: dict[str, torch.Tensor], inv_freq, rope_scaling, max_positions):
        super().__init__()
        self.spec = spec
        embed = sd["model.embed_tokens.weight"]
        self.embed = _param(embed)
        self.layers = nn.ModuleList(LlamaLayer(spec, sd, f"model.layers.{i}.") for i in range(spec.num_layers))
        self.norm = _param(sd["model.norm.weight"])
        lm_head = sd.get("lm_head.weight")
        self.lm_head = Linear(embed if spec.tie_word_embeddings or lm_head is None else lm_head)
        self.rotary = RotaryEmbedding(inv_freq, rope_scaling, max_positions, embed.dtype)

    @classmethod
    def from_hf(cls, source, config, max_positions: int) -> "LlamaModel":
        """`source`: an HF LlamaForCausalLM or its state_dict; `config`: its HF config."""
        spec = ModelSpec.from_hf_config(config)
        sd = source if isinstance(source, dict) else source.state_dict()
        inv_freq, scaling = rope_inv_freq(config, spec)
        with torch.no_grad():
            return cls(spec, sd, inv_freq, scaling, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttnMetadata,
        kv: torch.Tensor,
        logit_rows: torch.Tensor | slice,
    ) -> torch.Tensor:
        """Run T token rows; returns float logits [len(logit_rows), vocab] of the chosen rows.

        input_ids: long [T]; kv: the pool tensor [num_layers, 2, slots, kv_heads, max_seq_len,
        head_dim], written in place; logit_rows: long indices of rows whose logits are wanted.
        """
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(meta.positions)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv[i, 0], kv[i, 1], meta)
        x = rms_norm(residual[logit_rows] + x[logit_rows], self.norm, self.spec.rms_norm_eps)
        return self.lm_head(x).float()

    def prepack(self) -> "LlamaModel":
        """Prepack every linear weight for the device's fastest GEMM path (CPU float32 only)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        return self
