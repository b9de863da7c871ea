"""Copy the private pages of a stopped VM's RAM mapping into memory.

The guest must be stopped (QMP ``stop``) for a consistent copy; the copy lands in an anonymous
buffer so the caller can ``cont`` the guest before writing any file (downtime = stop -> readv).
"""

from __future__ import annotations

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
    data: bytearray
    page_size: int
    mem_pages: int
    n_runs: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.indexes)

    @property
    def nbytes(self) -> int:
        return len(self.data)


def capture_private(pid: int, vma: Vma, *, method: str = "auto") -> Capture:
    """Scan ``vma`` of ``pid`` for private pages and copy them out with process_vm_readv."""
    if vma.shared:
        raise MemSnapError(
            f"{vma.path} is mapped shared (share=on) in pid {pid}: its pages are not copy-on-write "
            "and cannot be diffed; run the VM with share=off on a frozen base"
        )
    t0 = time.perf_counter()
    runs = scan_private(pid, vma, method=method)
    t1 = time.perf_counter()
    n = sum(c for _, c in runs)
    data = bytearray(n * PAGE_SIZE)
    addr, holder = buffer_address(data)
    segments = []
    off = 0
    for first, cnt in runs:
        segments.append((addr + off, vma.start + first * PAGE_SIZE, cnt * PAGE_SIZE))
        off += cnt * PAGE_SIZE
    try:
        transfer(pid, segments, write=False)
    finally:
        del holder
    t2 = time.perf_counter()
    idx = array("I")
    base = vma.first_page
    for first, cnt in runs:
        idx.extend(range(base + first, base + first + cnt))
    return Capture(
        idx, data, PAGE_SIZE, vma.first_page + vma.n_pages, len(runs),
        {"scan": (t1 - t0) * 1e3, "readv": (t2 - t1) * 1e3},
    )
