"""Keep a model process's freed memory for its next forward pass instead of handing it back.

glibc's malloc serves large blocks (a forward pass's activations: tens of MB for a prompt
chunk) with mmap and returns them to the system when freed, so every pass faults its buffers
in again, page by page, and the kernel zeroes each page. In a virtual machine whose memory the
host backs lazily (Firecracker, most cloud VMs with free page reporting), a page the guest
touches for the first time, or again after the host reclaimed it, costs several microseconds
more: measured here, a fresh process's first 1024-token prefill passes took 400-730 ms against
~210 ms once its memory was its own. PyTorch's CPU performance guide suggests jemalloc or
tcmalloc for the same reason; `keep_freed_memory` gets the effect from glibc itself (mallopt):
blocks come from the heap and stay mapped after free, so a process's footprint settles at its
peak and later passes reuse the same pages. A model worker runs it before loading the model,
then `ModelRunner.warm_up` faults in a full-size pass's buffers at start-up.
"""

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap (glibc's own ceiling is 32 MB)
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes: the top of the heap is never given back


def keep_freed_memory() -> bool:
    """-> True where glibc took the settings; False elsewhere (other libc, macOS, Windows),
    where nothing changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return mmap_ok and trim_ok
