"""pdq.ops.memory: a process that keeps its freed memory reuses it without faulting pages in again."""

import subprocess
import sys

import pytest

CHILD = """
import resource, sys
from pdq.ops.memory import keep_freed_memory
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


RESERVE_CHILD = """
import resource, sys, threading
from pdq.ops.memory import keep_freed_memory, reserve_heap
assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
def model_thread():  # as a worker's: reserve, then a pass's worth of blocks of assorted sizes
    reserved = reserve_heap(int(sys.argv[1]) << 20)
    f0 = faults()
    blocks = [bytearray(mb << 20) for mb in (8, 3, 20, 1, 8, 16, 8, 2, 30, 4)]
    out.append((reserved >> 20, faults() - f0))
t = threading.Thread(target=model_thread)
t.start()
t.join()
print(*out[0])
"""


def faults_after_reserve(mb: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", RESERVE_CHILD, str(mb)], capture_output=True, text=True, check=True)
    reserved, faults = out.stdout.split()
    return int(reserved), int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_reserved_heap_serves_a_model_threads_later_blocks_without_page_faults():
    pages = (100 << 20) // 4096  # the blocks: 100 MB
    reserved, faults = faults_after_reserve(0)
    assert reserved == 0 and faults > pages // 2  # fresh pages, each faulted in
    reserved, faults = faults_after_reserve(160)
    assert reserved == 160
    assert faults < pages // 20
