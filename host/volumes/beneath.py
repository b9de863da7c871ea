"""Paths inside a volume resolved by the kernel as if the volume were `/`.

A volume holds what guests wrote, symlinks included (`x -> /etc`). Every path the API or a
guest names is opened with openat2(2) and RESOLVE_IN_ROOT: `..` stops at the volume's
root and absolute symlinks are taken relative to it, in one atomic kernel lookup, so no
check-then-open race lets a guest swap a directory for a symlink in between. Python has
no openat2 binding (3.11 to 3.13), hence the ctypes call; everything after it works on
file descriptors (`dir_fd=`, `os.fstat`, `shutil.rmtree(dir_fd=)`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
from typing import Self

from .errors import InvalidVolume

_SYS_OPENAT2 = 437          # the same number on every architecture (generic syscall table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str, flags: int, mode: int = 0,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(path),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EINTR, errno.EAGAIN):  # EAGAIN: a rename raced the lookup
            raise OSError(err, os.strerror(err), path)


def clean(path: str) -> str:
    """`path` as an absolute, normalised path inside the volume (`a/../b/` -> `/b`)."""
    if not path:
        raise InvalidVolume("path cannot be empty")
    if "\0" in path:
        raise InvalidVolume("path must not contain NUL bytes")
    out = posixpath.normpath("/" + path.lstrip("/"))
    return "/" if out == "//" else out


def split(path: str) -> tuple[str, str]:
    """(parent, name) of a cleaned path other than `/`."""
    parent, name = posixpath.split(path)
    return parent or "/", name


class Root:
    """A volume's directory, held open; every lookup below it stays inside it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        """The fd of `path` (cleaned; `/` is the root), symlinks resolved inside it."""
        if path == "/":
            return os.open(".", flags | os.O_CLOEXEC, dir_fd=self.fd)
        return openat2(self.fd, path.lstrip("/"), flags, mode)

    def open_dir(self, path: str) -> int:
        return self.open(path, os.O_RDONLY | os.O_DIRECTORY)
