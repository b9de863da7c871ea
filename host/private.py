"""Files and directories only root may read: the state dir and its database, keys, guest
memory, the VMs' work dirs.

Their modes are set here explicitly, never left to the process umask (the usual 0022
would make them world-readable). A private directory also covers what other programs
(QEMU, the block server) write into it with modes of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

from host.durable import write_atomic

DIR_MODE = 0o700
FILE_MODE = 0o600
FROZEN_MODE = 0o400   # immutable files (frozen memory bases)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a directory of mode 0700, made (with missing parents) if need be; an
    existing one is tightened."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if path.stat().st_mode & 0o7777 != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """`os.open(path, flags | O_CREAT)` for a file of mode 0600 (also when it existed)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` atomically and durably with a 0600 file holding `data`."""
    write_atomic(path, data)  # its temp file is made 0600 (mkstemp), whatever the umask


def tighten(path: str | os.PathLike[str], mode: int = FILE_MODE) -> None:
    """Give an existing file `mode` (no-op when it is absent)."""
    try:
        os.chmod(path, mode)
    except FileNotFoundError:
        pass


def create_private(path: str | os.PathLike[str], data: bytes) -> bool:
    """Create `path` as a 0600 file holding `data` unless it exists (its directory made
    0700 if missing); False when it existed. O_EXCL: of two services starting at once,
    one writes and both then read the same secret."""
    path = Path(path)
    if not path.parent.exists():
        private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def secret_file(path: str | os.PathLike[str], nbytes: int = 32) -> bytes:
    """The secret kept in `path` as hex, made (0600, `nbytes` random bytes) on first use."""
    path = Path(path)
    if not path.exists():
        private_dir(path.parent)
        create_private(path, (os.urandom(nbytes).hex() + "\n").encode())
    return bytes.fromhex(path.read_text().strip())


__all__ = ["DIR_MODE", "FILE_MODE", "FROZEN_MODE", "create_private", "open_private", "private_dir",
           "secret_file", "tighten", "write_private"]
