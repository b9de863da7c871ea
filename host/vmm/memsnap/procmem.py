"""Copy memory between this process and another one with process_vm_readv / process_vm_writev.

Each call takes at most IOV_MAX iovecs per side; a transfer can stop early at an iovec
boundary (e.g. an unmapped remote page), so the loop resumes from where the kernel stopped and
fails only when no progress is made.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

from .errors import MemSnapError

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


for _name in ("process_vm_readv", "process_vm_writev"):
    _fn = getattr(_libc, _name)
    _fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    _fn.restype = ctypes.c_ssize_t

#: (local address, remote address, length in bytes)
Segment = tuple[int, int, int]


def buffer_address(buf: bytearray | memoryview | mmap.mmap) -> tuple[int, object]:
    """Address of a writable buffer plus the ctypes object that pins it (keep it alive)."""
    n = buf.nbytes if isinstance(buf, memoryview) else len(buf)
    if n == 0:
        return 0, None
    holder = (ctypes.c_char * n).from_buffer(buf)
    return ctypes.addressof(holder), holder


def transfer(pid: int, segments: Sequence[Segment], *, write: bool) -> int:
    """Copy every segment (remote <- local if ``write`` else local <- remote). Returns bytes."""
    fn = _libc.process_vm_writev if write else _libc.process_vm_readv
    what = "process_vm_writev" if write else "process_vm_readv"
    total = 0
    i = 0
    skip = 0  # bytes of segments[i] already done
    local = (_IoVec * IOV_MAX)()
    remote = (_IoVec * IOV_MAX)()
    while i < len(segments):
        batch = segments[i : i + IOV_MAX]
        want = 0
        for j, (laddr, raddr, length) in enumerate(batch):
            off = skip if j == 0 else 0
            local[j].iov_base, local[j].iov_len = laddr + off, length - off
            remote[j].iov_base, remote[j].iov_len = raddr + off, length - off
            want += length - off
        got = fn(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            e = ctypes.get_errno()
            raise MemSnapError(f"{what} on pid {pid} failed: {os.strerror(e)} (errno {e})")
        if got == 0 and want > 0:
            raise MemSnapError(
                f"{what} on pid {pid} made no progress at remote {hex(batch[0][1] + skip)}"
            )
        total += got
        # advance (i, skip) by `got` bytes
        while got > 0:
            left = segments[i][2] - skip
            if got >= left:
                got -= left
                i += 1
                skip = 0
            else:
                skip += got
                got = 0
        while i < len(segments) and segments[i][2] == 0:
            i += 1
    return total
