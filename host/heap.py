"""Keeping a long-running process's C heap from ratcheting up its RSS.

Under glibc's malloc a service's RSS climbed with no Python object leaking (bench/bench_gc.py
with an oss repository: tracemalloc's traced heap flat while RSS rose by steps of ~20 MiB at
each template build; the growth was in the threads' malloc arenas). Two causes, two
settings, made at start (`configure`, before any thread):

- a buffer past the mmap threshold (128 KiB) is mmapped, and unmapped when freed, but each
  such free raises the threshold (up to 32 MiB), so later big buffers (s3transfer's 8 MiB
  parts, zstd's windows, file reads) come from the arenas, whose freed pages glibc keeps
  and fragments: the threshold is fixed instead (`M_MMAP_THRESHOLD`, which also turns
  the adjustment off), so big buffers go back to the system when freed;
- every thread that allocates may get an arena of its own (up to 8 per core), each with
  its own free pages: two are enough for a process whose work is in one event loop
  (`M_ARENA_MAX`).

And after work that freed much (a collection), `trim` hands the arenas' free pages back.
No library does this; it is two libc calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

M_MMAP_THRESHOLD = -3  # <malloc.h>
M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 << 10  # glibc's own default, kept fixed
ARENA_MAX = 2

_libc: Any
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _libc.malloc_trim.argtypes = [ctypes.c_size_t]
    _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
except (OSError, AttributeError):  # not glibc (musl has neither): nothing to do
    _libc = None


def configure() -> bool:
    """Fix the mmap threshold and cap the arenas (call before any thread starts); False
    where the C library is not glibc."""
    if _libc is None:
        return False
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(_libc.mallopt(M_ARENA_MAX, ARENA_MAX))


def trim() -> bool:
    """Return the arenas' free pages to the system; True when some were."""
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))
