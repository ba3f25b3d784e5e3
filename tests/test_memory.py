"""pdq.memory: a process that keeps its freed memory reuses it without faulting pages in again."""

import subprocess
import sys

import pytest

CHILD = """
import resource, sys
from pdq.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
size = 48 << 20  # above glibc's largest dynamic mmap threshold (32 MB)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = bytearray(size)  # zeroed: every page touched
del block
f0 = faults()
block = bytearray(size)
print(faults() - f0)
"""


def faults_of_second_allocation(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_memory_is_reused_without_page_faults():
    pages = (48 << 20) // 4096
    assert faults_of_second_allocation("default") > pages // 2  # glibc hands it back and faults it in again
    assert faults_of_second_allocation("keep") < pages // 20
