"""Host allocator policy for tensor math on the CPU: keep freed memory for the next step.

glibc's malloc serves big blocks (logits, activations, their gradients: hundreds of MB each in a
training step) with fresh mmap()s and hands them back to the kernel when freed, so every step
touches its memory for the first time again: one page fault per 4 KiB (an 8×256 step on SmolLM2
spent ~1.5 s of ~12 s there). Serving them from the heap and not trimming it keeps the pages: the
process's RSS stays at its peak instead of returning to idle between steps, like a GPU caching
allocator. Only glibc has these knobs; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_applied = False


def keep_freed_memory() -> bool:
    """Heap, not mmap, for big blocks, and no trimming of freed heap; once per process. True when
    the C library took it."""
    global _applied
    if _applied:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    if not _applied:
        log.info("the C library refused the allocator settings: big host blocks stay mmap()ed")
    return _applied
