"""Byte sources behind layers: a local file, or (cache.py) a repository object read in chunks.

A blob hands out `(fd, offset, length)` pieces so the block server can `sendfile` them
straight from the page cache to the NBD socket.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class Blob(Protocol):
    """Read-only random access to a layer file's bytes."""

    size: int

    def pread(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset` (may block on the network for remote blobs)."""
        ...

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, int, bool]]:
        """(fd, fd_offset, length, owned) pieces covering the range; close owned fds after use."""
        ...

    def is_local(self, offset: int, length: int) -> bool:
        """True when reading the range cannot block on the network."""
        ...

    def close(self) -> None: ...


class FileBlob:
    """A blob that is a local file, opened once."""

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        self.path = Path(path)
        self.fd = fd if fd is not None else os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        while len(data) < length:
            more = os.pread(self.fd, length - len(data), offset + len(data))
            if not more:
                raise EOFError(f"{self.path}: short read at {offset + len(data)}")
            data += more
        return data

    def pieces(self, offset: int, length: int) -> list[tuple[int, int, int, bool]]:
        return [(self.fd, offset, length, False)]

    def is_local(self, offset: int, length: int) -> bool:
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
