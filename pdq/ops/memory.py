"""Keep a model process's freed memory for its next forward pass instead of handing it back.

glibc's malloc serves large blocks (a forward pass's activations: tens of MB for a prompt
chunk) with mmap and returns them to the system when freed, so every pass faults its buffers
in again, page by page, and the kernel zeroes each page. In a virtual machine whose memory the
host backs lazily (Firecracker, most cloud VMs with free page reporting), a page the guest
touches for the first time, or again after the host reclaimed it, costs several microseconds
more, so a fresh process's first large passes (a 1024-token prefill) run far slower than the
same passes once its memory is its own. PyTorch's CPU performance guide suggests jemalloc or
tcmalloc for the same reason; `keep_freed_memory` gets the effect from glibc itself (mallopt):
blocks come from the heap and stay mapped after free, so a process's footprint settles at its
peak and later passes reuse the same pages. A model worker runs it before loading the model,
then `ModelRunner.warm_up` faults in a full-size pass's buffers at start-up, and `reserve_heap`
faults in room to spare: a burst's passes of other shapes (many chunks with masks, a full decode
batch) grow the heap past the warm-up's peak, and every fresh page they touched would cost a
page fault on the first users' requests.
"""

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap (glibc's own ceiling is 32 MB)
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes: the top of the heap is never given back
RESERVE_BLOCK = 32 << 20  # bytes reserve_heap allocates at a time
DEFAULT_HEAP_RESERVE_MB = 256  # WorkerConfig.heap_reserve_mb, and the bench's in-process baselines


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc (or the C library there is), loaded once. Raises OSError where none is found."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory() -> bool:
    """Also puts every thread that has not allocated yet in glibc's main arena (M_ARENA_MAX 1):
    a thread's own arena grows in separate heaps of at most 64 MB, and memory that
    `reserve_heap` leaves there is not reused by the passes that follow (they fault fresh
    pages in anyway), while the main arena's is. Call it first thing in a model process,
    before it starts threads; called again later it changes nothing
    for threads that already allocated. -> True where glibc took the settings; False elsewhere
    (other libc, macOS, Windows), where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    mallopt(M_ARENA_MAX, 1)  # best effort: without it only reserve_heap loses its effect
    return mmap_ok and trim_ok


def reserve_heap(nbytes: int) -> int:
    """Faults in `nbytes` of the heap and frees them again. Under `keep_freed_memory` the pages
    stay the process's, so the allocations of later forward passes reuse them instead of
    faulting fresh pages in. Call it from the thread that runs the model, after the warm-up.
    -> bytes touched: 0 where glibc is not there, or `keep_freed_memory` did not take (freed
    blocks would go back to the system)."""
    if nbytes <= 0 or not keep_freed_memory():
        return 0
    malloc, free = _libc().malloc, _libc().free
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    blocks, touched = [], 0
    try:
        while touched < nbytes:
            size = min(RESERVE_BLOCK, nbytes - touched)
            block = malloc(size)
            if not block:
                break
            ctypes.memset(block, 0, size)
            blocks.append(block)
            touched += size
    finally:
        for block in blocks:  # all at once, after all are touched: each its own memory
            free(block)
    return touched
