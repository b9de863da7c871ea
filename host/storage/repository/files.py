"""Durable local file writes the repositories make: a temp file renamed into place, a hard
link or a copy that keeps holes, a write stream that leaves zero chunks as holes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from host.durable import fsync_dir


@contextlib.contextmanager
def atomic(dst: Path) -> Iterator[Path]:
    """A temp path next to `dst`, renamed over it (and the directory fsynced) on success."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".tmp-")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(1 << 20):
            h.update(buf)
    return h.hexdigest()



def link_or_copy(src: Path, dst: Path) -> int:
    """Make `dst` an atomic, durable copy of `src`: a hard link when both are on one
    filesystem, else a copy that keeps holes (memory files are mostly zeros). Returns
    the bytes copied (0 for a link)."""
    with atomic(dst) as tmp:
        tmp.unlink()
        try:
            os.link(src, tmp)
        except OSError:
            return copy_sparse(src, tmp)
    return 0


class SparseWriter:
    """A write-only stream onto a file that leaves all-zero chunks as holes (fetched memory
    files stay as sparse as the originals), hashing what it is given."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.pos = 0
        self.hash = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        self.hash.update(data)
        if n and bytes(data).count(0) != n:
            self.f.seek(self.pos)
            self.f.write(data)
        self.pos += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> None:
        self.f.truncate(self.pos)
        self.f.flush()


def copy_sparse(src: Path, dst: Path) -> int:
    """Copy `src` to `dst` keeping its holes; returns the data bytes copied."""
    copied = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                data = os.lseek(f.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            hole = os.lseek(f.fileno(), data, os.SEEK_HOLE)
            f.seek(data)
            out.seek(data)
            left = hole - data
            while left > 0:
                buf = f.read(min(left, 1 << 20))
                if not buf:
                    break
                out.write(buf)
                left -= len(buf)
                copied += len(buf)
            pos = hole
        out.truncate(size)
        out.flush()
        os.fsync(out.fileno())
    return copied

