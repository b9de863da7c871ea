"""Write a diff chain into a freshly spawned VM's RAM mapping with process_vm_writev.

The target is a QEMU started on the same base file with ``share=off -incoming defer -S``: its
RAM is the base, so writing the chain's pages (each becomes a private CoW copy) reproduces the
snapshot's RAM without copying the base. Each page is written once, from the newest diff.
"""

from __future__ import annotations

from .chain import DiffChain
from .diff import DiffFile
from .errors import MemSnapError, SnapshotMismatchError
from .pagemap import PAGE_SIZE, Vma
from .procmem import Segment, buffer_address, transfer


def inject_chain(pid: int, vma: Vma, chain: DiffChain) -> int:
    """Write the chain's view into ``vma`` of ``pid``. Returns the number of pages written."""
    if vma.shared:
        raise MemSnapError(f"{vma.path} is mapped shared in pid {pid}: injecting would change the base file")
    if chain.page_size != PAGE_SIZE:
        raise SnapshotMismatchError(f"diff page size {chain.page_size} != host page size {PAGE_SIZE}")
    lo, hi = vma.first_page, vma.first_page + vma.n_pages
    if chain.mem_pages != hi or lo != 0:
        raise SnapshotMismatchError(
            f"the diff is for {chain.mem_pages} pages of RAM, the mapping of {vma.path} in pid {pid} "
            f"covers pages {lo}..{hi}"
        )
    # Group the winning pages per file, then cut them into runs contiguous on both sides.
    per_file: dict[int, tuple[DiffFile, list[tuple[int, int]]]] = {}
    for p, (f, i) in chain.view().items():
        per_file.setdefault(id(f), (f, []))[1].append((p, i))
    holders: list[object] = []
    segments: list[Segment] = []
    total = 0
    holder: object = None
    try:
        for f, pages in per_file.values():
            pages.sort()
            addr, holder = buffer_address(f.mmap)
            holders.append(holder)
            start_p, start_i, n = pages[0][0], pages[0][1], 0
            for p, i in pages:
                if p == start_p + n and i == start_i + n:
                    n += 1
                    continue
                segments.append((addr + f.data_offset_of(start_i), vma.start + (start_p - lo) * PAGE_SIZE, n * PAGE_SIZE))
                start_p, start_i, n = p, i, 1
            segments.append((addr + f.data_offset_of(start_i), vma.start + (start_p - lo) * PAGE_SIZE, n * PAGE_SIZE))
            total += len(pages)
        transfer(pid, segments, write=True)
    finally:
        # drop every pointer into the mmaps, or closing the chain fails with BufferError
        segments.clear()
        holders.clear()
        holder = None
    return total
