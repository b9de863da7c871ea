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

Python's own small-object allocator (pymalloc) keeps its 1 MiB arenas while one object
lives in them: after 300 soak lifecycles the service's RSS still crept (+6 MiB over the
last 200, ~30 KiB a lifecycle) with the traced heap flat. `use_c_malloc` re-executes the
service with PYTHONMALLOC=malloc, so small objects come from glibc too, whose free pages
inside the heap `trim` returns (malloc_trim releases them wherever they are). An
operator's own PYTHONMALLOC is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
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


def use_c_malloc() -> None:
    """Re-execute this interpreter (same pid, same argv) with PYTHONMALLOC=malloc, unless
    the variable is set (the operator's choice, or this is the re-executed one) or the C
    library is not glibc. Call first thing in `__main__`: nothing has run yet."""
    if _libc is None or "PYTHONMALLOC" in os.environ:
        return
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "PYTHONMALLOC": "malloc"})
