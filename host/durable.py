"""Making a write survive a crash: the fsync of a file by its path, and of a directory
after a rename or link in it (without which the new name may be lost with the power), and
a small file replaced whole or not at all (`write_atomic`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Replace `path` with a file holding `data`, whole or not at all: a temp file beside it
    (mode 0600, as mkstemp makes it), written, fsynced, renamed over `path`, and the
    directory fsynced. `fsync=False`: atomic only (a crash may lose the new content, never
    leave a torn one)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
