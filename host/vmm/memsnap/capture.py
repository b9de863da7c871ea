"""Copy the private pages of a stopped VM's RAM mapping into memory.

The guest must be stopped (QMP ``stop``) for a consistent copy; the copy lands in an anonymous
buffer so the caller can ``cont`` the guest before writing any file (downtime = stop -> readv).
"""

from __future__ import annotations

import mmap
import time
from array import array
from dataclasses import dataclass, field

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

    @property
    def count(self) -> int:
        return len(self.indexes)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def close(self) -> None:
        """Release the page buffer (the capture's data is unusable afterwards)."""
        self.data.release()
        if self.buffer is not None:
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


def capture_private(pid: int, vma: Vma, *, method: str = "auto",
                    buffer: mmap.mmap | None = None) -> Capture:
    """Scan ``vma`` of ``pid`` for private pages and copy them out with process_vm_readv.

    The pages land in ``buffer`` if it is large enough (it then belongs to the Capture), else
    in a new anonymous mapping. Call ``Capture.close()`` when done."""
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
        if buffer is not None:
            buffer.close()
        buffer = alloc_buffer(n, populate=False)
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
        len(runs), {"scan": (t1 - t0) * 1e3, "readv": (t2 - t1) * 1e3}, buffer,
    )
