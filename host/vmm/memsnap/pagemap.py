"""Find the guest-RAM mapping of a QEMU process and list its private (copy-on-write) pages.

A VM whose RAM is a ``MAP_PRIVATE`` mapping of a frozen base file gets an anonymous page for
every guest page written since start: the host kernel copies the file page on the first write.
Those pages are exactly the ones that differ from the base. Reads never make pages private.

Two scanners give the same answer:

* ``PAGEMAP_SCAN`` ioctl (Linux >= 6.7): ranges that are (present or swapped) and not file-backed.
* a ``pread`` of ``/proc/PID/pagemap``: one u64 per page, keep ``(bit63|bit62) and not bit61``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import MemSnapError

PAGE_SIZE = mmap.PAGESIZE

# pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst)
PM_PRESENT = 1 << 63
PM_SWAPPED = 1 << 62
PM_FILE = 1 << 61

# PAGEMAP_SCAN categories (include/uapi/linux/fs.h)
PAGE_IS_WPALLOWED = 1 << 0
PAGE_IS_WRITTEN = 1 << 1
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PAGE_IS_SWAPPED = 1 << 4
PAGE_IS_PFNZERO = 1 << 5
PAGE_IS_HUGE = 1 << 6

#: page runs: (first page index relative to the start of the VMA, number of pages)
Runs = list[tuple[int, int]]


class _PmScanArg(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("walk_end", ctypes.c_uint64),
        ("vec", ctypes.c_uint64),
        ("vec_len", ctypes.c_uint64),
        ("max_pages", ctypes.c_uint64),
        ("category_inverted", ctypes.c_uint64),
        ("category_mask", ctypes.c_uint64),
        ("category_anyof_mask", ctypes.c_uint64),
        ("return_mask", ctypes.c_uint64),
    ]


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


assert ctypes.sizeof(_PmScanArg) == 96 and ctypes.sizeof(_PageRegion) == 24
# _IOWR('f', 16, struct pm_scan_arg)
PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_PmScanArg) << 16) | (ord("f") << 8) | 16

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int


@dataclass(frozen=True)
class Vma:
    """One mapping line of /proc/PID/maps."""

    start: int
    end: int
    perms: str
    offset: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def shared(self) -> bool:
        return self.perms[3] == "s"

    @property
    def first_page(self) -> int:
        """Index, in pages of the mapped file, of the VMA's first page."""
        return self.offset // PAGE_SIZE

    @property
    def n_pages(self) -> int:
        return self.size // PAGE_SIZE


def find_vma(pid: int, mem_path: str | os.PathLike[str]) -> Vma:
    """The single writable mapping of ``mem_path`` in process ``pid``.

    QEMU maps a memory-backend-file once, with the whole file. Raises MemSnapError if the
    process is gone, the file is not mapped, or it is mapped more than once writable.
    """
    want = os.path.realpath(mem_path)
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise MemSnapError(f"process {pid} is gone (reading /proc/{pid}/maps)") from exc
    found: list[Vma] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path != want:
            continue
        lo, hi = parts[0].split("-")
        vma = Vma(int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), path)
        if "w" in vma.perms:
            found.append(vma)
    if not found:
        raise MemSnapError(f"{want} is not mapped writable in process {pid}")
    if len(found) > 1:
        raise MemSnapError(f"{want} is mapped {len(found)} times in process {pid}: {found}")
    return found[0]


def _merge(runs: Iterable[tuple[int, int]]) -> Runs:
    out: Runs = []
    for first, n in runs:
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n > 0:
            out.append((first, n))
    return out


def scan_private_ioctl(pid: int, vma: Vma, *, vec_len: int = 512) -> Runs:
    """Private page runs via the PAGEMAP_SCAN ioctl. Raises OSError if the kernel lacks it."""
    vec = (_PageRegion * vec_len)()
    arg = _PmScanArg()
    arg.size = ctypes.sizeof(_PmScanArg)
    arg.vec = ctypes.addressof(vec)
    arg.vec_len = vec_len
    arg.category_inverted = PAGE_IS_FILE
    arg.category_mask = PAGE_IS_FILE
    arg.category_anyof_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED
    arg.return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED
    out: list[tuple[int, int]] = []
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        start = vma.start
        while start < vma.end:
            arg.start, arg.end, arg.walk_end = start, vma.end, 0
            n = _libc.ioctl(fd, PAGEMAP_SCAN, ctypes.byref(arg))
            if n < 0:
                e = ctypes.get_errno()
                raise OSError(e, f"PAGEMAP_SCAN on pid {pid}: {os.strerror(e)}")
            for r in vec[:n]:
                out.append(((r.start - vma.start) // PAGE_SIZE, (r.end - r.start) // PAGE_SIZE))
            # Kernel quirk (seen on 6.18): when the walk spans several internal buffers and then
            # completes, walk_end keeps the last early-stop address; n < vec_len means "done".
            if n < vec_len or arg.walk_end >= vma.end or arg.walk_end <= start:
                break
            start = arg.walk_end
    finally:
        os.close(fd)
    out.sort()
    return _merge(out)


def scan_private_pagemap(pid: int, vma: Vma, *, chunk_pages: int = 65536) -> Runs:
    """Private page runs from a plain pread of /proc/PID/pagemap (any kernel)."""
    out: Runs = []
    run_first = -1
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        page = 0
        n_pages = vma.n_pages
        while page < n_pages:
            n = min(chunk_pages, n_pages - page)
            raw = os.pread(fd, n * 8, (vma.start // PAGE_SIZE + page) * 8)
            if len(raw) != n * 8:
                raise MemSnapError(f"short read of /proc/{pid}/pagemap")
            if raw.count(0) == len(raw):  # nothing mapped in this chunk
                if run_first >= 0:
                    out.append((run_first, page - run_first))
                    run_first = -1
                page += n
                continue
            entries = array("Q", raw)
            for i, e in enumerate(entries):
                private = (e & (PM_PRESENT | PM_SWAPPED)) and not (e & PM_FILE)
                if private:
                    if run_first < 0:
                        run_first = page + i
                elif run_first >= 0:
                    out.append((run_first, page + i - run_first))
                    run_first = -1
            page += n
        if run_first >= 0:
            out.append((run_first, n_pages - run_first))
    finally:
        os.close(fd)
    return out


def scan_private(pid: int, vma: Vma, *, method: str = "auto") -> Runs:
    """Private (CoW'd or anonymous) page runs of ``vma``, relative to its start, sorted.

    ``method`` is "auto" (ioctl, then pagemap if the kernel lacks PAGEMAP_SCAN), "ioctl" or
    "pagemap".
    """
    if method not in ("auto", "ioctl", "pagemap"):
        raise ValueError(f"unknown scan method {method!r}")
    try:
        if method in ("auto", "ioctl"):
            try:
                return scan_private_ioctl(pid, vma)
            except OSError as exc:
                if method == "ioctl" or exc.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        return scan_private_pagemap(pid, vma)
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise MemSnapError(f"process {pid} is gone (scanning pagemap)") from exc
    except OSError as exc:
        raise MemSnapError(f"cannot scan the pagemap of process {pid}: {exc}") from exc


def runs_to_indexes(runs: Runs, first_page: int = 0) -> array[int]:
    """Expand runs into a sorted array of page indexes (offset by ``first_page``)."""
    idx = array("Q")
    for first, n in runs:
        idx.extend(range(first_page + first, first_page + first + n))
    return idx
