"""Freed memory back to the system while a model built sparse trains (glibc's mmap threshold).

glibc serves a block above its mmap threshold with ``mmap`` and unmaps it when freed. The
threshold starts at 128 KiB and rises to the size of any such block freed (up to 32 MiB); from
then on the blocks of a layer (its kept values, gradient and moments, its activations: a few
MB each) come from the heap, whose freed memory the process keeps. A model built sparse
(`materialize`) is one that only fits sparse, so it trains near the machine's memory: fixing
the threshold at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops it moving) returns
every freed block of that size at once. What it changes on the 3B recipe model:
benchmarks/README.md ("built sparse"). A threshold the user set (``MALLOC_MMAP_THRESHOLD_``)
is left alone; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["THRESHOLD", "return_freed_blocks"]

THRESHOLD = 1 << 20
"""Blocks of this many bytes or more are unmapped when freed."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_done = False


def return_freed_blocks() -> bool:
    """Fix glibc's mmap threshold at `THRESHOLD` for this process (once); whether it is set
    now (False: not glibc on Linux, or the user chose a threshold)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _done = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD))
    return _done
