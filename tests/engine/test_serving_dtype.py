"""The dtype a worker loads its model in when none is given (`--dtype`, PDQ_DTYPE): bfloat16 on
a CPU with AMX or AVX512_BF16, float32 on other CPUs, the runtime's default on a GPU; and a real worker started
without one on this machine runs what `serving_dtype` says for it."""

import os
import subprocess
import sys

import pytest
import torch

from pdq.engine.runner import resolve_dtype, serving_dtype
from pdq.ops.cpu import cpu_flags

CPU = torch.device("cpu")
AMX = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
ZEN4 = frozenset({"avx512f", "avx512_bf16"})  # AVX512_BF16 without AMX (AMD Zen 4)


def test_bfloat16_on_a_cpu_with_bfloat16_matrix_instructions_float32_on_others():
    assert serving_dtype(CPU, None, AMX) == torch.bfloat16
    assert serving_dtype(CPU, "float32", AMX) == torch.bfloat16  # a float32 checkpoint too
    assert serving_dtype(CPU, None, ZEN4) == torch.bfloat16
    assert serving_dtype(CPU, None, frozenset({"avx2", "avx512f", "avx512_vnni"})) == torch.float32  # no bfloat16 unit
    assert serving_dtype(CPU, None, frozenset()) == torch.float32
    assert resolve_dtype("float32", CPU) == torch.float32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("", CPU) == serving_dtype(CPU, None, cpu_flags())  # this machine's default
    assert resolve_dtype(None, torch.device("cuda")) is None  # a GPU: the runtime's (checkpoint-aware) default


def test_a_worker_without_a_dtype_runs_this_machines_default(tmp_path):
    """tests/conftest.py pins PDQ_DTYPE=float32 for every other test; here it is left out."""
    env = {k: v for k, v in os.environ.items() if k != "PDQ_DTYPE"}
    code = ("from pdq.config import DecodeConfig; from pdq.engine.worker import load_runner; "
            "r = load_runner(DecodeConfig(model='builtin:tiny', max_seq_len=64), 256); print(r.dtype)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = serving_dtype(CPU, None, cpu_flags())
    assert out.stdout.strip().splitlines()[-1] == str(want)


def test_a_dtype_no_runtime_takes_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="dtype must be float32, float16, bfloat16, got 'bogus'"):
        resolve_dtype("bogus", CPU)
    out = subprocess.run([sys.executable, "-m", "pdq.cli", "bench", "--baseline", "engine", "--model", "builtin:tiny",
                          "--requests", "2", "--no-roofline", "--no-progress"],
                         env={**os.environ, "PDQ_DTYPE": "bogus"}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "dtype must be float32, float16, bfloat16, got 'bogus' (--dtype or PDQ_DTYPE)" in out.stderr


def test_torch_dtype_reads_the_names_dtype_name_writes():
    from pdq.engine.runner import dtype_name, torch_dtype

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch_dtype(dtype_name(dtype)) is dtype
    assert torch_dtype(None) is None and torch_dtype("") is None
    with pytest.raises(ValueError, match="dtype must be"):
        torch_dtype("int8")
