"""Keep freed memory in the process heap on CPU (glibc's malloc), so a step's tensors reuse it.

glibc serves allocations above M_MMAP_THRESHOLD (dynamic, at most 32 MB) with fresh mmaps and
gives them back with munmap on free, and trims the heap top above M_TRIM_THRESHOLD. A CPU step
allocates many such transients (attention's gathered K/V, the dequantized weight of a prefill
GEMM), so every step page-faults them in again: measured on 2 Zen4 cores, a 64-sequence decode
step of the default model took 780-870 ms that way and 270-300 ms with both thresholds raised.
Intel's PyTorch CPU guide gets the same effect by preloading jemalloc or tcmalloc; mallopt does
it without a preload. The cost: RSS stays at the step's high-water mark instead of shrinking.

The same thresholds keep what start-up frees (the GGUF reader's metadata, the loader's staging
copies) in the heap for good, so start-up hands it back once with malloc_trim
(`release_freed_memory`) after the weights are in place: freed pages leave the resident set, and
the steps' own transients are unaffected (they come back into the heap on their first step).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger("ember")

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # never trim the heap top (an int parameter)

_done = False


def keep_freed_memory_in_heap() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where there is no glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        logger.debug("mallopt refused the thresholds; freed CPU memory goes back to the OS each step")
    _done = ok
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS once (glibc's malloc_trim); False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
