"""Freed heap memory handed back to the operating system while a model loads.

Loading a quantised model makes and drops many temporaries of a few to tens of megabytes (decoded blocks, stacked
copies, dequantised slices). glibc's allocator keeps what they free inside the process for reuse (after the first
large frees it serves such sizes from its heap rather than from fresh mappings), so resident memory stays at the
load's high-water mark: on a 1B GGUF, about 0.4 GB more than the model holds (docs/kernels.md). ``malloc_trim``
returns it. Where the C library has no such call (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the system (glibc); whether the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
