"""File operations inside one volume, the way E2B's volume content API does them.

Semantics (E2B's orchestrator, pkg/volumes): paths are absolute within the volume; new
files default to uid/gid 9090 and mode 0666, directories to 0777, set explicitly after
creation (no umask); `force` on a file overwrites it and makes missing parents, on a
directory makes parents and accepts an existing one; without it an existing path is 409
and a missing parent 404; deleting is recursive and `/` cannot be deleted; listings are
depth-first in name order, at most 10 levels, the listed directory itself left out.
Modes are permission bits only: setuid, setgid and sticky are never set on the host.

Every lookup goes through `beneath.Root` (symlinks resolved inside the volume); names
are then used relative to an open parent fd, never as host paths. A written file appears
whole or not at all: it is written in the volume's staging directory (beside the volume,
on the same filesystem, never visible inside it; emptied when the service starts) and
linked (no `force`) or renamed (`force`) into place.
"""

from __future__ import annotations

import builtins
import errno
import os
import secrets
import shutil
import stat as st
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Self

from .beneath import Root, clean, split
from .errors import InvalidVolume, PathExists, PathNotFound, VolumeError, VolumeFull

DEFAULT_UID = DEFAULT_GID = 9090
FILE_MODE = 0o666
DIR_MODE = 0o777
MAX_DEPTH = 10
TEMP_PREFIX = ".aenv-upload-"


@dataclass(frozen=True)
class Entry:
    name: str
    type: str          # file | directory | symlink | unknown
    path: str
    size: int
    mode: int          # permission bits only
    uid: int
    gid: int
    atime: float
    mtime: float
    ctime: float
    target: str | None = None


def _kind(mode: int) -> str:
    if st.S_ISREG(mode):
        return "file"
    if st.S_ISDIR(mode):
        return "directory"
    if st.S_ISLNK(mode):
        return "symlink"
    return "unknown"


def _entry(path: str, s: os.stat_result, target: str | None = None) -> Entry:
    return Entry(name=os.path.basename(path) or "/", type=_kind(s.st_mode), path=path,
                 size=s.st_size, mode=st.S_IMODE(s.st_mode) & 0o777, uid=s.st_uid,
                 gid=s.st_gid, atime=s.st_atime, mtime=s.st_mtime, ctime=s.st_ctime,
                 target=target)


@contextmanager
def _errors(path: str) -> Iterator[None]:
    """OS errors of one operation on `path` as the statuses E2B answers."""
    try:
        yield
    except FileNotFoundError:
        raise PathNotFound(path) from None
    except FileExistsError:
        raise PathExists(path) from None
    except NotADirectoryError:
        raise InvalidVolume(f"a component of the path '{path}' is a file") from None
    except IsADirectoryError:
        raise InvalidVolume(f"path '{path}' is a directory") from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise VolumeFull("the volume's storage is full") from None
        if exc.errno == errno.ELOOP:
            raise InvalidVolume(f"too many levels of symbolic links in '{path}'") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise InvalidVolume(f"path '{path}' is too long") from None
        raise


def _set_meta(dir_fd: int, name: str, uid: int | None, gid: int | None,
              mode: int | None) -> None:
    """chown/chmod `name` (not following a final symlink: a symlink gets its owner only)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid,
                 dir_fd=dir_fd, follow_symlinks=False)
        return
    try:
        if uid is not None or gid is not None:
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
        if mode is not None:
            os.fchmod(fd, mode & 0o777)
    finally:
        os.close(fd)


class VolumeFiles:
    """The files of one volume directory (held open while the object lives) and its
    staging directory for uploads."""

    def __init__(self, directory: str | os.PathLike[str],
                 staging: str | os.PathLike[str], *, min_free_bytes: int = 0) -> None:
        self.min_free_bytes = min_free_bytes   # uploads stop (507) under it
        self.root = Root(directory)
        try:
            self.staging_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            self.root.close()
            raise

    def close(self) -> None:
        self.root.close()
        if self.staging_fd >= 0:
            os.close(self.staging_fd)
            self.staging_fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reading ----------------------------------------------------------------------

    def stat(self, path: str) -> Entry:
        path = clean(path)
        with _errors(path):
            if path == "/":
                return _entry("/", os.fstat(self.root.fd))
            parent, name = split(path)
            pfd = self.root.open_dir(parent)
            try:
                s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=pfd) if st.S_ISLNK(s.st_mode) else None
                return _entry(path, s, target)
            finally:
                os.close(pfd)

    def list(self, path: str, depth: int = 1) -> list[Entry]:
        depth = depth or 1
        if not 1 <= depth <= MAX_DEPTH:
            raise InvalidVolume(f"depth must be between 1 and {MAX_DEPTH}")
        path = clean(path)
        with _errors(path):
            fd = self.root.open_dir(path)
        out: builtins.list[Entry] = []
        try:
            self._walk(fd, path, depth, out)
        finally:
            os.close(fd)
        return out

    def _walk(self, fd: int, path: str, depth: int, out: builtins.list[Entry]) -> None:
        for name in sorted(os.listdir(fd)):
            child = f"{path.rstrip('/')}/{name}"
            try:
                s = os.stat(name, dir_fd=fd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=fd) if st.S_ISLNK(s.st_mode) else None
            except FileNotFoundError:
                continue          # removed while we listed
            out.append(_entry(child, s, target))
            if depth > 1 and st.S_ISDIR(s.st_mode):
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, dir_fd=fd)
                except OSError:
                    continue      # replaced by a symlink or removed meanwhile
                try:
                    self._walk(sub, child, depth - 1, out)
                finally:
                    os.close(sub)

    def open_read(self, path: str) -> tuple[int, Entry]:
        """An fd reading the file at `path` (symlinks followed inside the volume)."""
        path = clean(path)
        with _errors(path):
            fd = self.root.open(path, os.O_RDONLY | os.O_NONBLOCK)
        s = os.fstat(fd)
        if not st.S_ISREG(s.st_mode):
            os.close(fd)
            raise InvalidVolume(f"path '{path}' is not a file")
        os.set_blocking(fd, True)
        return fd, _entry(path, s)

    # ---- writing ----------------------------------------------------------------------

    def _parent(self, parent: str, *, make: bool, uid: int, gid: int) -> int:
        """An fd of directory `parent`, made (with its own parents) if `make`."""
        try:
            return self.root.open_dir(parent)
        except FileNotFoundError:
            if not make:
                raise
        up, name = split(parent)
        ufd = self._parent(up, make=True, uid=uid, gid=gid)
        try:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=ufd)
                _set_meta(ufd, name, uid, gid, DIR_MODE)
            except FileExistsError:
                pass              # made by a concurrent writer
            return self.root.open_dir(parent)
        finally:
            os.close(ufd)

    def make_dir(self, path: str, *, uid: int | None = None, gid: int | None = None,
                 mode: int | None = None, force: bool = False) -> Entry:
        path = clean(path)
        uid = DEFAULT_UID if uid is None else uid
        gid = DEFAULT_GID if gid is None else gid
        with _errors(path):
            if path == "/":
                if not force:
                    raise PathExists(path)
                return self.stat(path)
            parent, name = split(path)
            pfd = self._parent(parent, make=force, uid=uid, gid=gid)
            try:
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=pfd)
                except FileExistsError:
                    s = os.stat(name, dir_fd=pfd)
                    if not (force and st.S_ISDIR(s.st_mode)):
                        raise
                    return self.stat(path)
                _set_meta(pfd, name, uid, gid, DIR_MODE if mode is None else mode)
            finally:
                os.close(pfd)
        return self.stat(path)

    def create(self, path: str, *, force: bool = False,
               uid: int | None = None, gid: int | None = None) -> Upload:
        """A new file at `path`, written through the returned `Upload`."""
        path = clean(path)
        if path == "/":
            raise InvalidVolume("path '/' is a directory")
        parent, name = split(path)
        with _errors(path):
            pfd = self._parent(parent, make=force,
                               uid=DEFAULT_UID if uid is None else uid,
                               gid=DEFAULT_GID if gid is None else gid)
            if not force:
                try:
                    os.stat(name, dir_fd=pfd, follow_symlinks=False)
                    os.close(pfd)
                    raise PathExists(path)
                except FileNotFoundError:
                    pass
        return Upload(self, pfd, path, name, force)

    def set_meta(self, path: str, *, uid: int | None = None, gid: int | None = None,
                 mode: int | None = None) -> Entry:
        path = clean(path)
        with _errors(path):
            if path == "/":
                if uid is not None or gid is not None:
                    os.fchown(self.root.fd, -1 if uid is None else uid,
                              -1 if gid is None else gid)
                if mode is not None:
                    os.fchmod(self.root.fd, mode & 0o777)
            else:
                parent, name = split(path)
                pfd = self.root.open_dir(parent)
                try:
                    _set_meta(pfd, name, uid, gid, mode)
                finally:
                    os.close(pfd)
        return self.stat(path)

    def remove(self, path: str) -> None:
        path = clean(path)
        if path == "/":
            raise InvalidVolume("cannot delete root")
        parent, name = split(path)
        with _errors(path):
            pfd = self.root.open_dir(parent)
            try:
                s = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if st.S_ISDIR(s.st_mode):
                    shutil.rmtree(name, dir_fd=pfd)
                else:
                    os.unlink(name, dir_fd=pfd)
            finally:
                os.close(pfd)


class Upload:
    """One file being written: `write` the bytes, then `commit` (or `abort`). Until the
    commit the bytes sit in the staging directory."""

    def __init__(self, files: VolumeFiles, dir_fd: int, path: str, name: str,
                 force: bool) -> None:
        self.files, self.dir_fd, self.path, self.name, self.force = (
            files, dir_fd, path, name, force)
        self.temp = f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        self.staging_fd = files.staging_fd
        try:
            self.fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                              | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.staging_fd)
        except BaseException:
            os.close(dir_fd)
            raise

    def write(self, data: bytes) -> None:
        v = os.statvfs(self.fd)
        if v.f_bavail * v.f_frsize - len(data) < self.files.min_free_bytes:
            raise VolumeFull("the node's disk is under its floor: the upload was dropped")
        with _errors(self.path):
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]

    def commit(self, *, uid: int | None = None, gid: int | None = None,
               mode: int | None = None) -> Entry:
        try:
            with _errors(self.path):
                os.fchown(self.fd, DEFAULT_UID if uid is None else uid,
                          DEFAULT_GID if gid is None else gid)
                os.fchmod(self.fd, (FILE_MODE if mode is None else mode) & 0o777)
                os.fsync(self.fd)
                if self.force:
                    os.rename(self.temp, self.name, src_dir_fd=self.staging_fd,
                              dst_dir_fd=self.dir_fd)
                else:   # link(2) never replaces: a file made meanwhile is still 409
                    os.link(self.temp, self.name, src_dir_fd=self.staging_fd,
                            dst_dir_fd=self.dir_fd, follow_symlinks=False)
        except BaseException:
            self.abort()
            raise
        self.abort()   # drops the temporary name (after link) and the fds
        return self.files.stat(self.path)

    def abort(self) -> None:
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        try:
            os.unlink(self.temp, dir_fd=self.staging_fd)
        except FileNotFoundError:
            pass          # renamed into place
        os.close(self.dir_fd)


__all__ = ["Entry", "Upload", "VolumeError", "VolumeFiles"]
