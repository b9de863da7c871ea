"""Copy the private pages of a stopped VM's RAM mapping into memory.

The guest must be stopped (QMP ``stop``) for a consistent copy; the copy lands in an anonymous
buffer so the caller can ``cont`` the guest before writing any file (downtime = stop -> readv).
"""

from __future__ import annotations

import mmap
import os
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MemSnapError
from .pagemap import PAGE_SIZE, Vma, scan_private
from .procmem import buffer_address, transfer


@dataclass
class Capture:
    """Pages copied out of a process: sorted file page indexes and their data back to back."""

    indexes: array[int]
    data: memoryview  # over ``buffer``; released by close()
    page_size: int
    mem_pages: int
    n_runs: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    buffer: mmap.mmap | None = None
    owns_buffer: bool = True

    @property
    def count(self) -> int:
        return len(self.indexes)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def close(self) -> None:
        """Release the page buffer (the capture's data is unusable afterwards)."""
        self.data.release()
        if self.buffer is not None and self.owns_buffer:
            self.buffer.close()


def alloc_buffer(n_pages: int, *, populate: bool = True) -> mmap.mmap:
    """Anonymous memory for ``n_pages`` pages, pre-faulted if ``populate``.

    Allocate it *before* stopping the guest: faulting in tens of MiB costs as much as copying
    them (~100 ms for 64 MiB here), and that time would otherwise count as guest downtime.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(1, n_pages) * PAGE_SIZE, flags=flags)


def file_buffer(path: Path, n_pages: int) -> mmap.mmap:
    """A shared mapping of a new, already unlinked file of ``n_pages`` pages under ``path``.

    For a VM that stays stopped (a pause), the copy need not be quick, but it must not
    need memory: a pause is what frees memory, and the guard of memory pressure pauses
    the biggest guests last, when the node has least to spare. Pages copied here are page
    cache the kernel can write back and drop, where an anonymous buffer the size of the
    guest's dirty memory could only be OOM-killed. Unlinked at once: nothing is left
    behind, whatever happens."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.unlink(path)
        size = max(1, n_pages) * PAGE_SIZE
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def capture_private(pid: int, vma: Vma, *, method: str = "auto",
                    buffer: mmap.mmap | None = None, owned: bool = True,
                    grow: Callable[[int], mmap.mmap] | None = None) -> Capture:
    """Scan ``vma`` of ``pid`` for private pages and copy them out with process_vm_readv.

    The pages land in ``buffer`` if it is large enough, else in a new mapping from
    ``grow(n_pages)`` (default: anonymous memory). ``owned``: the Capture takes
    ``buffer`` over (closes it). Call ``Capture.close()``."""
    if vma.shared:
        raise MemSnapError(
            f"{vma.path} is mapped shared (share=on) in pid {pid}: its pages are not copy-on-write "
            "and cannot be diffed; run the VM with share=off on a frozen base"
        )
    t0 = time.perf_counter()
    runs = scan_private(pid, vma, method=method)
    t1 = time.perf_counter()
    n = sum(c for _, c in runs)
    if buffer is None or len(buffer) < n * PAGE_SIZE:
        if buffer is not None and owned:
            buffer.close()
        buffer, owned = (grow(n) if grow is not None else alloc_buffer(n, populate=False)), True
    addr, holder = buffer_address(buffer)
    segments = []
    off = 0
    for first, cnt in runs:
        segments.append((addr + off, vma.start + first * PAGE_SIZE, cnt * PAGE_SIZE))
        off += cnt * PAGE_SIZE
    try:
        transfer(pid, segments, write=False)
    except BaseException:
        del holder
        if owned:
            buffer.close()
        raise
    del holder
    t2 = time.perf_counter()
    idx = array("I")
    base = vma.first_page
    for first, cnt in runs:
        idx.extend(range(base + first, base + first + cnt))
    return Capture(
        idx, memoryview(buffer)[: n * PAGE_SIZE], PAGE_SIZE, vma.first_page + vma.n_pages,
        len(runs), {"scan": (t1 - t0) * 1e3, "readv": (t2 - t1) * 1e3}, buffer, owned,
    )


class CaptureBuffer:
    """A pre-faulted copy buffer reused by every snapshot of one VM (owned by the VM object,
    which calls ``close()``): repeated snapshots then pay no allocation at all."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None

    def reserve(self, n_pages: int) -> mmap.mmap:
        """A buffer of at least ``n_pages`` pages (grown with 25 % slack when too small)."""
        if self._mm is None or len(self._mm) < n_pages * PAGE_SIZE:
            self.close()
            self._mm = alloc_buffer(n_pages + n_pages // 4)
        return self._mm

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()  # BufferError while a Capture still uses it: close that first
            self._mm = None
