"""`StackExport`: one stack as the NBD server sees it, every change under its lock, with
write-behind so a guest's fsync (and QEMU's flush at every pause) waits for little."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from pathlib import Path

from .appender import Rehashed
from .control import StackInfo
from .index import SegmentIndex
from .lsmt import SealedLayer
from .nbd import Piece
from .stack import Stack

# Write-behind: after this many bytes written into an upper, its dirty pages are sent
# to disk (without waiting). A flush (the guest's fsync, and QEMU's at every `stop`, so
# at every pause) then waits for the last few MiB only, not for everything the guest
# wrote since: the kernel's own writeback starts at a share of the host's RAM (GiBs).
WRITE_BEHIND = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
# sync_file_range(2) through libc: Python's os module has no binding for it.
_libc = ctypes.CDLL(None, use_errno=True)


def start_writeback(fd: int) -> None:
    """Start writing `fd`'s dirty pages to disk; does not wait for them. Best effort."""
    _libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SYNC_FILE_RANGE_WRITE)


class StackExport:
    """One stack served over NBD; its lock serializes every change to the stack."""

    read_only = False

    def __init__(self, stack: Stack, upper_id: str) -> None:
        self.stack = stack
        self.upper_id = upper_id
        self.lock = asyncio.Lock()
        self._unsent = 0  # bytes written since the last write-behind
        self._prehash: asyncio.Task[Rehashed | None] | None = None
        self._closing = threading.Event()  # stops a prehash of a stack going away

    @property
    def name(self) -> str:
        return self.stack.name

    @property
    def size(self) -> int:
        return self.stack.virtual_size

    def _resolve(self, offset: int, length: int) -> list[Piece]:
        out: list[Piece] = []
        try:
            for blob, boff, n in self.stack.pieces(offset, length):
                if blob is None:
                    out.append((None, 0, n, False))
                else:
                    out.extend(blob.pieces(boff, n))
        except BaseException:
            for fd, _o, _n, owned in out:
                if owned and fd is not None:
                    os.close(fd)
            raise
        return out

    def _all_local(self, offset: int, length: int) -> bool:
        return all(b is None or b.is_local(o, n) for b, o, n in self.stack.pieces(offset, length))

    async def read_pieces(self, offset: int, length: int) -> list[Piece]:
        async with self.lock:
            if self._all_local(offset, length):
                return self._resolve(offset, length)
            return await asyncio.to_thread(self._resolve, offset, length)

    async def write(self, offset: int, data: bytes | bytearray) -> None:
        async with self.lock:
            if (offset | len(data)) % 512:  # read-modify-write may fetch a remote chunk
                await asyncio.to_thread(self.stack.write, offset, data)
            else:
                self.stack.write(offset, data)  # page-cache write: does not block long
            self._unsent += len(data)
            if self._unsent >= WRITE_BEHIND:
                self._unsent = 0
                await asyncio.to_thread(start_writeback, self.stack.upper.data_fd)

    async def write_zeroes(self, offset: int, length: int) -> None:
        async with self.lock:
            if (offset | length) % 512:
                await asyncio.to_thread(self.stack.write_zeroes, offset, length)
            else:
                self.stack.write_zeroes(offset, length)

    async def flush(self) -> None:
        async with self.lock:
            await asyncio.to_thread(self.stack.flush)

    def prehash(self) -> None:
        """A seal is coming (a snapshot is about to stop the guest): rehash the upper's
        data file now, beside the writer, if overwrites made its running digest stale,
        so the seal does not read the whole file while the guest is stopped."""
        out, task = self.stack.upper.out, self._prehash
        if task is not None and not task.done():
            return
        if task is not None and task.exception() is None and out.holds(task.result()):
            return  # done, and no overwrite since: the seal takes it
        if not out.hasher_stale:
            return
        self._prehash = asyncio.create_task(asyncio.to_thread(out.rehash_beside,
                                                              self._closing.is_set))

    async def adopt_prehash(self) -> None:
        """Before a seal, under the lock: wait for a prehash and take its digest if no
        overwrite voided it (a void or failed one leaves the seal to rehash)."""
        task, self._prehash = self._prehash, None
        if task is None:
            return
        done = None
        with contextlib.suppress(OSError):
            done = await task
        self.stack.upper.out.adopt(done)

    async def aclose_prehash(self) -> None:
        """The stack is going away: stop a prehash and wait for its thread."""
        self._closing.set()
        task, self._prehash = self._prehash, None
        if task is not None:
            with contextlib.suppress(OSError):
                await task

    def info(self, nbd_socket: Path) -> StackInfo:
        return StackInfo(name=self.name, layers=tuple(self.stack.layer_digests),
                         virtual_size=self.size, nbd_socket=str(nbd_socket))



    async def rebase(self, layers: list[SealedLayer], below: SegmentIndex) -> None:
        """Swap the sealed layers for `layers` holding the same content (a compaction);
        `below` is their merged index. The upper goes on over them untouched. Reads that
        resolved pieces before the swap still send from the old layers' fds: those stay
        open until the server releases unused layers (a delete or a collection, later)."""
        async with self.lock:
            await asyncio.to_thread(self.stack.rebase, layers, below)
