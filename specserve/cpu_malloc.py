"""glibc malloc settings for the CPU path: big temporaries from the heap, the heap kept.

A forward on the CPU allocates and frees tensors of megabytes every layer (the K/V gathered for
attention, the MLP's intermediate rows, the logits). glibc serves a block above its mmap
threshold (128 KiB at start) with a fresh mmap and returns it with munmap on free, so every such
tensor costs a page fault per 4 KiB page each time it is allocated; the threshold only rises
(up to 32 MiB) as big blocks happen to be freed, and the heap above ``M_TRIM_THRESHOLD`` is
handed back to the kernel and faulted in again later. A process's speed then depends on its
allocation history: a fresh one runs the same pass several times slower than one that has
already run bigger ones (benchmarks/RESULTS.md).

``keep_large_allocations_on_heap`` fixes the thresholds for the whole process (the same call
PyTorch's CPU tuning guides make through jemalloc or tcmalloc, here without a new library):
blocks up to 32 MiB come from the heap, the heap is not trimmed below 1 GiB of free space, and
it grows 64 MiB at a time. The cost is memory the process keeps once it has used it (the peak
of its temporaries), which a serving process would reuse anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20   # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_applied = False


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version   # glibc only: musl has no mallopt of these parameters
        return libc
    except (OSError, AttributeError):
        return None


def keep_large_allocations_on_heap() -> bool:
    """Apply the settings above once per process. Returns whether they are in force (False
    off glibc, where the allocator is left as it is)."""
    global _applied
    if _applied:
        return True
    libc = _libc()
    if libc is None:
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if ok:
        _applied = True
        logger.info("malloc: blocks up to %d MiB from the heap, heap kept (CPU path)", MMAP_THRESHOLD >> 20)
    return ok
