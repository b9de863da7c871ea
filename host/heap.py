"""Giving the C heap's free memory back to the system after work that freed much.

Under glibc's malloc a long-running process's RSS ratchets up with no Python object
leaking (bench/bench_gc.py measured it: tracemalloc's traced heap flat over 60 sandbox
lifecycles while RSS rose): a buffer past the mmap threshold (128 KiB) is mmapped and
unmapped when freed, but each such free raises the threshold (up to 32 MiB), so later big
buffers (request bodies, file reads, JSON of large documents) come from the heap, whose
freed pages glibc keeps. `malloc_trim(0)` hands them back (every free page, by madvise,
not only the heap's top). Called after collections: they run at most every few minutes,
and the call takes milliseconds. No library does this; it is one libc call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

_trim: Callable[[int], int] | None
try:
    _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    _trim.argtypes = [ctypes.c_size_t]
    _trim.restype = ctypes.c_int
except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to do
    _trim = None


def trim() -> bool:
    """Return the heap's free pages to the system; True when some were."""
    if _trim is None:
        return False
    return bool(_trim(0))
