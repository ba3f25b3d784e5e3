"""pdq.engine.worker.set_torch_threads: torch's thread count changes, and MKL's dynamic threading stays
on (torch.set_num_threads alone turns it off, which made small products run on every thread)."""

import subprocess
import sys

CHILD = """
import ctypes, os, sys
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
try:
    dynamic = lib.mkl_serv_get_dynamic
except AttributeError:
    print("no-mkl")
    raise SystemExit
dynamic.restype = ctypes.c_int
if sys.argv[1] == "torch":
    torch.set_num_threads(1)
else:
    from pdq.engine.worker import set_torch_threads
    set_torch_threads(1)
threads = torch.get_num_threads()
torch.ones(1 << 20).mul_(2.0)  # a parallel op in the same thread keeps it
print(threads, dynamic())
"""


def threads_and_mkl_dynamic(how: str) -> str:
    return subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_set_torch_threads_changes_the_count_and_keeps_mkls_dynamic_threading():
    torch_alone = threads_and_mkl_dynamic("torch")
    if torch_alone == "no-mkl":  # a torch build without MKL: only the count is ours to set
        assert threads_and_mkl_dynamic("pdq") == "no-mkl"
        return
    assert torch_alone == "1 0"  # what set_torch_threads mends
    assert threads_and_mkl_dynamic("pdq") == "1 1"
