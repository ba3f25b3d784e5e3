"""The CPU kernel for decode attention over paged KV blocks (`csrc/paged_attention.c`).

torch has no attention that reads keys through a block table in place: gathering each step's
blocks into a contiguous tensor first copies every key twice over. So on CPU pdq builds one small
C function with the system's C compiler the first time a process needs it (well under a second;
optimized for the CPU it runs on) and keeps the library in a cache directory keyed by the source,
the flags and the CPU. Where no compiler is found, or off CPU, or for dtypes other than float32,
`pdq.engine.attention` gathers instead (the same numbers, slower); `available()` says which.
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

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# Compiled with -ffast-math (the dot products and exp vectorize), linked without it: a shared library
# linked with -ffast-math turns on flush-to-zero for the whole process when it loads.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
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
    key = hashlib.sha256(SOURCE.read_bytes() + flags.encode() + _cpu_id().encode()).hexdigest()[:16]
    path = cache_dir() / f"paged_attention-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
        except OSError as exc:
            log.warning("cannot write the kernel cache %s (%s; set PDQ_KERNEL_CACHE): decode attention gathers "
                        "its blocks (slower)", path.parent, exc)
            return None
        try:
            obj = tmp + ".o"
            subprocess.run([cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", obj], check=True, capture_output=True,
                           timeout=120)
            subprocess.run([cc, *LINK_FLAGS, obj, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)  # atomic: processes building at once each install a whole library
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("could not build the paged attention kernel (%s %s): decode attention gathers its "
                        "blocks (slower)", exc, detail.decode(errors="replace")[-500:])
            Path(tmp).unlink(missing_ok=True)
            return None
        finally:
            Path(tmp + ".o").unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime is the one this library uses
    lib.paged_decode_f32.restype = None
    lib.paged_decode_f32.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _tried
    if not _tried:
        with _lock:
            if not _tried:
                _lib = None if os.environ.get("PDQ_NO_CPU_KERNEL") else _build()
                _tried = True
    return _lib


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if need be)."""
    return _library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: float32 [B, q_heads, D]; k_cache, v_cache: [num_blocks, kv_heads, bs, D] contiguous;
    tables: int32 [B, max_blocks]; lens: int32 [B]. -> [B, q_heads, D]. Needs `available()`."""
    lib = _library()
    q = q.contiguous()
    b, heads, dim = q.shape
    kv_heads, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    ptr = ctypes.c_void_p
    lib.paged_decode_f32(ptr(q.data_ptr()), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()), ptr(tables.data_ptr()),
                         ptr(lens.data_ptr()), ptr(out.data_ptr()), b, kv_heads, heads // kv_heads, dim, bs,
                         tables.shape[1], scale, torch.get_num_threads())
    return out
