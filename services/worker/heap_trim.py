"""Give the C heap's free pages back to the system while the worker is idle.

A worker's forward thread allocates activation buffers whose sizes change with every
batch shape. glibc's dynamic mmap threshold rises to the largest such buffer freed, so
later ones come from the thread's malloc arena instead of their own mappings, and the
arena's free holes stay resident: RSS grows over hours of varied traffic without any
leak. ``malloc_trim(0)`` returns every whole free page of every arena
(``MADV_DONTNEED``), which costs milliseconds; doing it only once the engine has been
idle for a while keeps it off every step's path. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

IDLE_SECONDS_BEFORE_TRIM = 2.0  # no step for this long: the worker trims its heap once


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the heap's free pages to the system; whether anything was released
    (False also where there is no glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
