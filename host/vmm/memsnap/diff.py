"""The diff file: a sorted set of guest pages that differ from a base (or from a parent diff).

Layout (all integers little-endian)::

    off  size
      0     8  magic  b"AENVMDIF"
      8     4  version (1)
     12     4  page size in bytes
     16     8  count: number of pages in the file
     24     8  mem_pages: size of the guest RAM / base file in pages (every index is below it)
     32     4  kind: 0 = cumulative (pages differ from the base), 1 = delta (differ from parent)
     36     4  reserved, 0
     40    32  base_sha256: sha256 of the frozen base memory file
     72    32  config_sha256: hash of the QEMU configuration (command line) the pages belong to
    104    32  parent_digest: ``digest`` of the parent diff (delta), zeros (cumulative)
    136    32  digest: sha256 over the index bytes followed by the page data
    168     4  crc32 of bytes 0..168
    172     4  reserved, 0
    176  4*count  page indexes (u32, strictly increasing)
         ...   zero padding to a multiple of 4096
    data_off  count*page_size  page data, in index order

The file is exactly ``data_off + count * page_size`` bytes; anything else is corruption.
Files are written to a temporary name, fsynced and renamed into place.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import struct
import sys
import tempfile
import threading
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import BinaryIO, Self

from host.durable import fsync_dir

from .errors import CorruptSnapshotError, MemSnapError, SnapshotMismatchError

MAGIC = b"AENVMDIF"
VERSION = 1
HEADER = struct.Struct("<8sIIQQII32s32s32s32sII")
HEADER_SIZE = HEADER.size  # 176
ALIGN = 4096
ZERO_DIGEST = bytes(32)
assert HEADER_SIZE == 176


class DiffKind(IntEnum):
    CUMULATIVE = 0  # the pages that differ from the base file
    DELTA = 1  # the pages that differ from the parent diff's view


@dataclass(frozen=True)
class DiffHeader:
    page_size: int
    count: int
    mem_pages: int
    kind: DiffKind
    base_sha256: bytes
    config_sha256: bytes
    parent_digest: bytes
    digest: bytes

    @property
    def data_offset(self) -> int:
        return _data_offset(self.count)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.count * self.page_size


def _data_offset(count: int) -> int:
    return -(-(HEADER_SIZE + 4 * count) // ALIGN) * ALIGN


def _check_indexes(indexes: array[int], mem_pages: int) -> None:
    prev = -1
    for i in indexes:
        if i <= prev:
            raise MemSnapError(f"page indexes must be strictly increasing ({prev} then {i})")
        prev = i
    if prev >= mem_pages:
        raise MemSnapError(f"page index {prev} is beyond the guest RAM ({mem_pages} pages)")
    if prev >= 1 << 32:
        raise MemSnapError(f"page index {prev} does not fit the u32 index")


def write_diff(
    path: str | os.PathLike[str],
    *,
    indexes: array[int] | list[int],
    data: bytes | bytearray | memoryview,
    page_size: int,
    mem_pages: int,
    base_sha256: bytes,
    config_sha256: bytes,
    kind: DiffKind = DiffKind.CUMULATIVE,
    parent_digest: bytes = ZERO_DIGEST,
    fsync: bool = True,
) -> DiffHeader:
    """Write a diff atomically (temp file + fsync + rename) and return its header.

    ``data`` holds ``len(indexes)`` pages back to back, in index order.
    """
    idx = array("I", indexes)
    data = memoryview(data).cast("B")
    if data.nbytes != len(idx) * page_size:
        raise MemSnapError(f"{len(idx)} pages need {len(idx) * page_size} bytes of data, got {data.nbytes}")
    if len(base_sha256) != 32 or len(config_sha256) != 32 or len(parent_digest) != 32:
        raise MemSnapError("base_sha256, config_sha256 and parent_digest must be 32 bytes")
    if (kind == DiffKind.DELTA) == (parent_digest == ZERO_DIGEST):
        raise MemSnapError("a delta diff needs a parent digest and a cumulative one must not have one")
    _check_indexes(idx, mem_pages)
    if idx.itemsize != 4:
        raise MemSnapError("array('I') is not 32 bits on this platform")
    if sys.byteorder != "little":  # pragma: no cover - x86 only
        idx.byteswap()
    index_bytes = idx.tobytes()
    h = hashlib.sha256(index_bytes)
    # Hash in a second thread while this one writes (both drop the GIL); the header, which
    # holds the digest, is written last.
    hasher = threading.Thread(target=h.update, args=(data,), name="memsnap-diff-hash")
    hasher.start()
    data_offset = _data_offset(len(idx))
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(bytes(HEADER_SIZE))
                f.write(index_bytes)
                f.write(bytes(data_offset - HEADER_SIZE - len(index_bytes)))
                f.flush()
                if not _write_direct(tmp, data, data_offset):
                    f.write(data)
                    f.flush()
                hasher.join()
                header = DiffHeader(
                    page_size, len(idx), mem_pages, DiffKind(kind), base_sha256, config_sha256,
                    parent_digest, h.digest(),
                )
                os.pwrite(f.fileno(), _pack_header(header), 0)
                if fsync:
                    os.fsync(f.fileno())
        finally:
            hasher.join()
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        fsync_dir(path.parent)
    return header


# The data of a large diff goes to disk with O_DIRECT in big sequential writes: through
# the page cache, 224 MiB took 0.2-0.7 s here (allocating the cache pages) plus 0.1 s
# of fsync; direct, 0.11-0.13 s in all. A restore reads the file once, so the page
# cache gains little.
DIRECT_MIN = 4 << 20
DIRECT_CHUNK = 8 << 20


def _write_direct(path: str, data: memoryview, offset: int) -> bool:
    """Write `data` at `offset` of `path` with O_DIRECT; False (nothing written) where it
    cannot be: small data, a buffer not page-aligned, a filesystem without O_DIRECT."""
    if data.nbytes < DIRECT_MIN or not _page_aligned(data) or offset % ALIGN:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    try:
        done = 0
        while done < data.nbytes:
            try:
                done += os.pwrite(fd, data[done:done + DIRECT_CHUNK], offset + done)
            except OSError:
                if done:
                    raise
                return False  # EINVAL on the first write: no O_DIRECT here after all
        return True
    finally:
        os.close(fd)


def _page_aligned(view: memoryview) -> bool:
    if view.readonly or not view.c_contiguous or view.nbytes % ALIGN:
        return False
    try:
        anchor = ctypes.c_char.from_buffer(view)  # holds an export of `view`: dropped below
    except (TypeError, ValueError):
        return False
    address = ctypes.addressof(anchor)
    del anchor
    return address % ALIGN == 0



def _pack_header(h: DiffHeader) -> bytes:
    body = HEADER.pack(
        MAGIC, VERSION, h.page_size, h.count, h.mem_pages, int(h.kind), 0, h.base_sha256,
        h.config_sha256, h.parent_digest, h.digest, 0, 0,
    )
    crc = zlib.crc32(body[:168])
    return body[:168] + struct.pack("<II", crc, 0)


def parse_header(raw: bytes, *, name: str = "diff") -> DiffHeader:
    """Decode and check the fixed header (magic, version, crc)."""
    if len(raw) < HEADER_SIZE:
        raise CorruptSnapshotError(f"{name}: truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    (magic, version, page_size, count, mem_pages, kind, _r, base, config, parent, digest, crc,
     _r2) = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptSnapshotError(f"{name}: not a memsnap diff (magic {magic!r})")
    if version != VERSION:
        raise CorruptSnapshotError(f"{name}: unsupported diff version {version}")
    if zlib.crc32(raw[:168]) != crc:
        raise CorruptSnapshotError(f"{name}: header checksum mismatch")
    if page_size <= 0 or page_size & (page_size - 1) or kind not in (0, 1):
        raise CorruptSnapshotError(f"{name}: bad header fields (page size {page_size}, kind {kind})")
    return DiffHeader(page_size, count, mem_pages, DiffKind(kind), base, config, parent, digest)


class _Checked:
    """Keys of files whose digest this process has checked (the newest `limit`). A file
    that changes gets another key: its inode's ctime moves with any write, rename or
    chmod, so a diff rewritten in place, or put back under the same name, is hashed
    again. Threads checking one file wait for the first instead of hashing it too."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._done: dict[tuple[object, ...], None] = {}  # insertion order: oldest first
        self._busy: dict[tuple[object, ...], threading.Lock] = {}
        self._guard = threading.Lock()

    def once(self, key: tuple[object, ...], check: Callable[[], None]) -> None:
        with self._guard:
            if key in self._done:
                return
            lock = self._busy.setdefault(key, threading.Lock())
        with lock:
            try:
                with self._guard:
                    if key in self._done:
                        return
                check()  # raises on a mismatch: nothing is recorded, the next caller hashes
                with self._guard:
                    self._done[key] = None
                    while len(self._done) > self._limit:
                        del self._done[next(iter(self._done))]
            finally:
                with self._guard:  # a file that failed leaves no lock behind either
                    self._busy.pop(key, None)


_VERIFIED = _Checked()


class DiffFile:
    """A validated, memory-mapped diff file. Use as a context manager or call ``close()``."""

    def __init__(self, path: Path, header: DiffHeader, f: BinaryIO, mm: mmap.mmap) -> None:
        self.path = path
        self.header = header
        self._file = f
        self._mm = mm
        idx_bytes = mm[HEADER_SIZE : HEADER_SIZE + 4 * header.count]
        self.indexes = array("I", idx_bytes)
        self._pos = {p: i for i, p in enumerate(self.indexes)}

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = True) -> Self:
        """Open and check a diff: header, size, index order and (if ``verify``) the digest."""
        path = Path(path)
        try:
            f = open(path, "rb")  # noqa: SIM115 - owned by the DiffFile, closed by close()
        except OSError as exc:
            raise MemSnapError(f"cannot open diff {path}: {exc}") from exc
        try:
            size = os.fstat(f.fileno()).st_size
            header = parse_header(f.read(HEADER_SIZE), name=str(path))
            if size != header.file_size:
                raise CorruptSnapshotError(
                    f"{path}: size {size} but the header describes {header.file_size} bytes "
                    f"({header.count} pages){' (truncated)' if size < header.file_size else ''}"
                )
            # ACCESS_COPY (MAP_PRIVATE, writable) so ctypes can take the address of the pages
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        except BaseException:
            f.close()
            raise
        self = cls(path, header, f, mm)
        try:
            prev = -1
            for p in self.indexes:
                if p <= prev or p >= header.mem_pages:
                    raise CorruptSnapshotError(f"{path}: page index {p} out of order or out of range")
                prev = p
            if verify:
                self.verify()
        except BaseException:
            self.close()
            raise
        return self

    def verify(self) -> None:
        """Recompute the digest over indexes + data; raise CorruptSnapshotError on mismatch.
        Once per file in this process (`_VERIFIED`): the 16 children of a fork restore
        the same diff at once, and each hashing all of it was a third of their restore."""
        st = os.fstat(self._file.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
               self.header.digest)
        _VERIFIED.once(key, self._hash_check)

    def _hash_check(self) -> None:
        h = hashlib.sha256(memoryview(self._mm)[HEADER_SIZE : HEADER_SIZE + 4 * self.header.count])
        h.update(memoryview(self._mm)[self.header.data_offset : self.header.file_size])
        if h.digest() != self.header.digest:
            raise CorruptSnapshotError(f"{self.path}: page data checksum mismatch")

    @property
    def digest(self) -> bytes:
        return self.header.digest

    @property
    def count(self) -> int:
        return self.header.count

    @property
    def mmap(self) -> mmap.mmap:
        return self._mm

    def data_offset_of(self, i: int) -> int:
        """Offset, in the file, of the ``i``-th page's data."""
        return self.header.data_offset + i * self.header.page_size

    def page(self, index: int) -> bytes | None:
        """The content of guest page ``index`` if this diff holds it."""
        i = self._pos.get(index)
        if i is None:
            return None
        off = self.data_offset_of(i)
        return self._mm[off : off + self.header.page_size]

    def __contains__(self, index: int) -> bool:
        return index in self._pos

    def position(self, index: int) -> int | None:
        return self._pos.get(index)

    def iter_pages(self) -> Iterator[tuple[int, memoryview]]:
        """(page index, page data) in index order. The views die with ``close()``."""
        ps = self.header.page_size
        view = memoryview(self._mm)
        try:
            for i, p in enumerate(self.indexes):
                off = self.header.data_offset + i * ps
                yield p, view[off : off + ps]
        finally:
            view.release()

    def check_belongs_to(self, base_sha256: bytes, config_sha256: bytes | None = None) -> None:
        if self.header.base_sha256 != base_sha256:
            raise SnapshotMismatchError(
                f"{self.path} was taken on base {self.header.base_sha256.hex()[:16]}, "
                f"not {base_sha256.hex()[:16]}"
            )
        if config_sha256 is not None and self.header.config_sha256 != config_sha256:
            raise SnapshotMismatchError(f"{self.path} was taken with another QEMU configuration")

    def close(self) -> None:
        try:
            self._mm.close()
        finally:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
