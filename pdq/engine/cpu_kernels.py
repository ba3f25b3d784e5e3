"""CPU kernels: decode attention over paged KV blocks (`csrc/paged_attention.c`) and a decoder
layer's fused elementwise work (`csrc/fused_ops.c`).

torch has no attention that reads keys through a block table in place: gathering each step's
blocks into a contiguous tensor first copies every key twice over. And a layer's RMSNorms, rotary
embedding and SwiGLU run in torch as several ops each, every one a pass over the whole tensor
(RMSNorm alone: square, mean, rsqrt, two multiplies). So on CPU pdq builds a few small C
functions with the system's C compiler the first time a process needs them (about a second;
optimized for the CPU it runs on) and keeps the library in a cache directory keyed by the
sources, the flags and the CPU. Each kernel is built for float32 and for bfloat16 tensors (the
arithmetic float32 in both; bfloat16 rounded where torch's bfloat16 ops round: `csrc/elem.h`),
but SwiGLU, float32 alone (`layers.silu_and_mul`).
Where no compiler is found, or off CPU, or for other dtypes, `pdq.engine.attention` gathers
instead and the layers run torch's ops (the same numbers up to rounding, slower); `available()`
and `fused_ops()` say which.
`PDQ_NO_CPU_KERNEL` turns all of them off, `PDQ_NO_FUSED_OPS` the fused elementwise ones alone.
"""

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("pdq.engine")

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_attention.c", "fused_ops.c")]
HEADERS = [Path(__file__).with_name("csrc") / "elem.h"]  # included by the sources: part of the cache key
DTYPES = (torch.float32, torch.bfloat16)  # kernels are built for both: NAME_f32, NAME_bf16 (silu_mul: _f32)
# Compiled with -ffast-math (the dot products and exp vectorize), linked without it: a shared library
# linked with -ffast-math turns on flush-to-zero for the whole process when it loads.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
# On x86-64 CPUs with AVX-512, loops vectorize 512 bits wide rather than GCC's default 256 (no effect
# on a CPU without AVX-512): on a Xeon with AMX, the bfloat16 engine's mixed run 1.6-7% faster (three
# alternating pairs of 8 runs), float32's unchanged.
if platform.machine() in ("x86_64", "AMD64"):
    COMPILE_FLAGS.append("-mprefer-vector-width=512")
LINK_FLAGS = ["-shared", "-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    """Where built kernels are kept: $PDQ_KERNEL_CACHE, else ~/.cache/pdq/kernels."""
    return Path(os.environ.get("PDQ_KERNEL_CACHE") or Path.home() / ".cache" / "pdq" / "kernels")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: paged decode attention gathers its blocks (slower)")
        return None
    flags = " ".join([cc, *COMPILE_FLAGS, "|", *LINK_FLAGS])
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS) + flags.encode()
                         + _cpu_id().encode()).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
        except OSError as exc:
            log.warning("cannot write the kernel cache %s (%s; set PDQ_KERNEL_CACHE): decode attention gathers "
                        "its blocks (slower)", path.parent, exc)
            return None
        objs = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
        try:
            for src, obj in zip(SOURCES, objs):
                subprocess.run([cc, *COMPILE_FLAGS, "-c", str(src), "-o", obj], check=True, capture_output=True,
                               timeout=120)
            subprocess.run([cc, *LINK_FLAGS, *objs, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)  # atomic: processes building at once each install a whole library
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("could not build the CPU kernels (%s %s): decode attention gathers its blocks and the "
                        "layers run torch's ops (slower)", exc, detail.decode(errors="replace")[-500:])
            Path(tmp).unlink(missing_ok=True)
            return None
        finally:
            for obj in objs:
                Path(obj).unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one this library uses
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name, args in (("paged_decode", [ptr] * 6 + [i32] * 6 + [f32, i32]),
                       ("rms_norm", [ptr, i64, ptr, ptr, i64, i32, i32, f32, i32]),
                       ("add_rms_norm", [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i32, f32, i32]),
                       ("rotary", [ptr, i64, i32, i32, i32, ptr, ptr, i32]),
                       ("rotary_kv", [ptr, i64, i32, i32, i32, i32, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32]),
                       ("silu_mul", [ptr, i64, ptr, i32, i32, i32])):
        for suffix in ("f32",) if name == "silu_mul" else ("f32", "bf16"):
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype, fn.argtypes = None, args
    return lib


def _kernel(name: str, dtype: torch.dtype):
    """The built kernel `name` for tensors of `dtype` (one of DTYPES)."""
    if dtype not in DTYPES:
        raise ValueError(f"the CPU kernels take float32 or bfloat16 tensors, got {dtype}")
    return getattr(_library(), f"{name}_{'f32' if dtype == torch.float32 else 'bf16'}")


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = None if os.environ.get("PDQ_NO_CPU_KERNEL") else _build()
                _tried = True
    return _lib


def available() -> bool:
    """Whether the kernels are built and loaded (building them now if need be)."""
    return _library() is not None


def fused_ops() -> bool:
    """Whether the layers' fused elementwise kernels are to be used (built, not turned off)."""
    return not os.environ.get("PDQ_NO_FUSED_OPS") and available()


def _rows_view(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a [rows, dim] view whose last dim is contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a [rows, dim] view with a contiguous last dim, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    return x.shape[0], x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual_add: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm of x [rows, dim] by weight [dim] (float32 or bfloat16, both alike) -> a new [rows,
    dim] tensor. With `residual_add` [rows, dim]: x += residual_add first, in place (x must be
    contiguous rows of its own, not a view others read). Needs `fused_ops()`."""
    ptr = ctypes.c_void_p
    rows, stride = _rows_view(x)
    dim = x.shape[1]
    out = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if residual_add is None:
        _kernel("rms_norm", x.dtype)(ptr(x.data_ptr()), stride, ptr(weight.data_ptr()), ptr(out.data_ptr()), dim,
                                     rows, dim, eps, torch.get_num_threads())
    else:
        _, add_stride = _rows_view(residual_add)
        _kernel("add_rms_norm", x.dtype)(ptr(x.data_ptr()), stride, ptr(residual_add.data_ptr()), add_stride,
                                         ptr(weight.data_ptr()), ptr(out.data_ptr()), dim, rows, dim, eps,
                                         torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotates x [rows, heads, head_dim] in place (each row's heads contiguous; rows may be a
    view's, any stride apart) by cos, sin_signed [rows, 1, head_dim] (contiguous). -> x.
    Needs `fused_ops()`."""
    rows, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or not (cos.is_contiguous() and sin_signed.is_contiguous()):
        raise ValueError("rotary_: x's heads must be contiguous in each row, cos and sin_signed contiguous")
    ptr = ctypes.c_void_p
    _kernel("rotary", x.dtype)(ptr(x.data_ptr()), x.stride(0), rows, heads, dim, ptr(cos.data_ptr()),
                               ptr(sin_signed.data_ptr()), torch.get_num_threads())
    return x


def rotary_kv_(qk: torch.Tensor, q_heads: int, cos: torch.Tensor, sin_signed: torch.Tensor, v: torch.Tensor,
               kv_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """`rotary_` of qk [rows, q_heads + kv_heads, head_dim] in place, and in the same pass this
    step's K/V into a layer's pool: the rotated k heads and v [rows, kv_heads, head_dim] (heads
    contiguous in each row) at `kv_rows` (long [rows * kv_heads], rows of the pool viewed as
    [-1, head_dim]; see `attention.kv_rows`) of k_cache and v_cache (contiguous). -> qk.
    Needs `fused_ops()`."""
    rows, heads, dim = qk.shape
    kv_heads = heads - q_heads
    if (qk.stride(2) != 1 or qk.stride(1) != dim or v.stride(2) != 1 or v.stride(1) != dim
            or not (cos.is_contiguous() and sin_signed.is_contiguous() and k_cache.is_contiguous()
                    and v_cache.is_contiguous() and kv_rows.is_contiguous())
            or kv_rows.dtype != torch.int64 or kv_rows.numel() != rows * kv_heads
            or tuple(v.shape) != (rows, kv_heads, dim)):
        raise ValueError("rotary_kv_: qk's and v's heads must be contiguous in each row, the tables, caches and "
                         "int64 kv_rows [rows * kv_heads] contiguous")
    ptr = ctypes.c_void_p
    _kernel("rotary_kv", qk.dtype)(ptr(qk.data_ptr()), qk.stride(0), rows, q_heads, kv_heads, dim,
                                   ptr(cos.data_ptr()), ptr(sin_signed.data_ptr()), ptr(v.data_ptr()), v.stride(0),
                                   ptr(kv_rows.data_ptr()), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()),
                                   torch.get_num_threads())
    return qk


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of float32 gate_up [rows, 2 * inter] = [gate | up] -> a new [rows, inter]. Needs
    `fused_ops()`."""
    if gate_up.dtype != torch.float32:
        raise ValueError(f"silu_and_mul: float32 only, got {gate_up.dtype}")
    rows, stride = _rows_view(gate_up)
    inter = gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    ptr = ctypes.c_void_p
    _kernel("silu_mul", gate_up.dtype)(ptr(gate_up.data_ptr()), stride, ptr(out.data_ptr()), rows, inter,
                                       torch.get_num_threads())
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, q_heads, D]; k_cache, v_cache: [num_blocks, kv_heads, bs, D] contiguous, of q's
    dtype (float32 or bfloat16); tables: int32 [B, max_blocks]; lens: int32 [B]. -> [B, q_heads,
    D]. Needs `available()`."""
    if not (k_cache.dtype == v_cache.dtype == q.dtype):
        raise ValueError(f"paged_decode: q {q.dtype}, k_cache {k_cache.dtype} and v_cache {v_cache.dtype} must match")
    q = q.contiguous()
    b, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    ptr = ctypes.c_void_p
    _kernel("paged_decode", q.dtype)(ptr(q.data_ptr()), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()),
                                     ptr(tables.data_ptr()), ptr(lens.data_ptr()), ptr(out.data_ptr()), b, kv_heads,
                                     heads // kv_heads, dim, bs, tables.shape[1], scale, torch.get_num_threads())
    return out
