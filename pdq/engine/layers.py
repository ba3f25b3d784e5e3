"""Building blocks of the Llama forward: linear, RMSNorm, rotary embedding, SwiGLU.

Each op computes the same function as its Hugging Face counterpart in the same precision,
so logits agree with `LlamaForCausalLM` up to float rounding noise.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdq.engine import cpu_kernels
from pdq.ops.cpu import cpuinfo_field


def packed_rows(vendor: str) -> range:
    """Row counts for which oneDNN's prepacked GEMM beats torch's BLAS (MKL) path.

    On Intel (AVX-512) MKL is well tuned for GEMV-like products (1..3 rows) and for large
    prefill batches, so only the sizes in between (4..640 rows) gain from skipping the weight's
    re-packing. On other vendors (e.g. AMD EPYC) MKL takes a slow, generic path at every size,
    so the prepacked path serves every row count, small decode batches most of all.
    """
    return range(4, 641) if vendor == "GenuineIntel" else range(1, 1 << 31)


def cpu_vendor() -> str:
    """The x86 vendor id (GenuineIntel, AuthenticAMD), or "" where /proc/cpuinfo does not say."""
    return cpuinfo_field("vendor_id")


PACKED_ROWS = packed_rows(cpu_vendor())
BUCKET_ROWS = 64  # bfloat16 GEMMs of more rows than this run at a multiple of it (`gemm_rows`)


def gemm_rows(rows: int, dtype: torch.dtype) -> int:
    """The row count a prepacked CPU GEMM of `rows` rows runs at: `rows` itself in float32 and up
    to BUCKET_ROWS rows, else the next multiple of BUCKET_ROWS (the extra rows zeros, their output
    dropped). oneDNN builds its bfloat16 GEMM anew for each row count it has not seen (on a Xeon
    with AMX, a first call at 700-1,000 rows took 4-10 ms, the next 0.3-3 ms), and a prompt
    pass's row count is the sum of its chunks, often new: at most 1/16 of a 1,024-row pass in
    zero rows buys a bounded set of counts, built once at start-up (`ModelRunner.warm_gemms`).
    Measured there in bfloat16, the in-process engine on `mixed` with a new seed (new prompt
    lengths) each of 8 runs: 1,501 and 1,549 tok/s against 1,473 and 1,512 without either.
    float32 GEMMs cost 0.4 ms or less to build: they run at their own count."""
    if dtype != torch.bfloat16 or rows <= BUCKET_ROWS:
        return rows
    return -(-rows // BUCKET_ROWS) * BUCKET_ROWS


class Linear(nn.Module):
    """y = x @ weight.T + bias, weight [out_features, in_features].

    On CPU in float32 or bfloat16, `prepack()` (call it after moving to the device) also keeps
    the weight in oneDNN's blocked layout: GEMMs then skip re-packing the weight on every call.
    Which row counts take that path is `packed_rows()` in float32, chosen per CPU vendor, and
    every row count in bfloat16 (oneDNN's bfloat16 GEMM, on AMX where the CPU has it: measured
    on a Xeon with AMX, 1.5-2.5x faster than torch's own path at 1-256 rows, as fast beyond), at
    the row counts of `gemm_rows`.
    Costs a second copy of the weight in memory.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.packed = None

    def prepack(self) -> None:
        w = self.weight
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16)
                or not torch.backends.mkldnn.is_available()):
            return
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        except (AttributeError, RuntimeError):  # a torch build without these oneDNN ops
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (x.shape[0] in PACKED_ROWS or x.dtype == torch.bfloat16):
            rows = x.shape[0]
            padded = gemm_rows(rows, x.dtype)
            if padded == rows:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]
        return F.linear(x, self.weight, self.bias)


def _fused(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether x's elementwise work runs in pdq's fused CPU kernels (`cpu_kernels.fused_ops`):
    on CPU, float32 or bfloat16, the `others` it reads or writes (weights, tables, caches) of
    its dtype."""
    return (x.dtype in cpu_kernels.DTYPES and x.device.type == "cpu" and all(o.dtype == x.dtype for o in others)
            and cpu_kernels.fused_ops())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back (as HF's LlamaRMSNorm).
    `weight` is [dim], or any shape that broadcasts over x's trailing dims (e.g. one weight row
    per head of [T, heads, head_dim])."""
    if weight.dim() == 1 and x.dim() == 2 and x.stride(1) == 1 and _fused(x, weight):
        return cpu_kernels.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def residual_rms_norm(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream and its RMSNorm: (x + add, rms_norm(x + add)). On CPU (float32 or
    bfloat16) in one pass that adds into x in place (x [rows, dim] is a layer's own stream, read by nobody
    else); elsewhere two ops."""
    if weight.dim() == 1 and x.dim() == 2 and x.is_contiguous() and add.dim() == 2 and _fused(x, add, weight):
        return x, cpu_kernels.rms_norm(x, weight, eps, residual_add=add)
    x = x + add
    return x, rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up` for `gate_up = [gate | up]` along the last dim. On CPU in
    float32 in one pass (`cpu_kernels.silu_and_mul`); in bfloat16 torch's two ops, which convert
    with the CPU's own bfloat16 instructions where the kernel rounds in integer arithmetic: 1.5x
    faster here (measured on a Xeon with AVX512_BF16: 138 against 210 us for 256 rows)."""
    if gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.dtype == torch.float32 and _fused(gate_up):
        return cpu_kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding with a precomputed cos/sin table for positions [0, max_positions).

    `inv_freq` is float32 [head_dim // 2]; `scaling` multiplies cos and sin (1.0 except for
    some scaled RoPE variants). The table is cast to the model dtype, as HF does per call.
    HF's `x * cos + rotate_half(x) * sin` is computed as `x * cos + swap_halves(x) * sin_signed`
    with sin_signed = [-sin | sin]: the same products, so the same float results.
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(torch.float32)[None, :]
        cos, sin = (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed for `positions` [T], each [T, 1, head_dim]: gather once per step."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [T, heads, head_dim] (HF's rotate_half convention). On CPU in float32 or
        bfloat16 (heads contiguous in each row) in place, returning x; elsewhere a new tensor."""
        t, h, d = x.shape
        if (x.stride(2) == 1 and x.stride(1) == d and cos.is_contiguous() and sin_signed.is_contiguous()
                and _fused(x, cos, sin_signed)):
            return cpu_kernels.rotary_(x, cos, sin_signed)
        swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2 | x1]
        return x * cos + swapped * sin_signed


def rotary_and_store(qk: torch.Tensor, q_heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, kv_rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Rotates qk [T, q_heads + kv_heads, head_dim] (`RotaryEmbedding.apply`). On CPU (float32 or
    bfloat16) it also writes this step's K/V (the rotated k heads, v) into the layer's pool at `kv_rows`
    in the same pass (`cpu_kernels.rotary_kv_`). -> (the rotated qk, whether K/V were written)."""
    d = qk.shape[2]
    if (_fused(qk, v, cos, sin_signed, k_cache, v_cache) and qk.stride(2) == 1 and qk.stride(1) == d
            and v.stride(2) == 1 and v.stride(1) == d
            and cos.is_contiguous() and sin_signed.is_contiguous() and k_cache.is_contiguous()
            and v_cache.is_contiguous() and kv_rows.dtype == torch.int64):
        return cpu_kernels.rotary_kv_(qk, q_heads, cos, sin_signed, v, kv_rows, k_cache, v_cache), True
    return RotaryEmbedding.apply(qk, cos, sin_signed), False
