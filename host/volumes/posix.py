"""The POSIX operations a guest's mount asks for (envd/volumes/wire.py), done inside one
volume for one guest.

Every name is looked up through `beneath.Root` (the volume is `/`: a guest's symlinks
resolve inside it) and acted on relative to its parent's fd, a final symlink never
followed except where POSIX follows it (open for read/write/truncate, resolved inside the
volume too). Setuid and setgid bits are never set on the host: modes keep 0o1777. Files
and directories are owned by the uid/gid the guest's caller had (the guest kernel checks
permissions against them: `default_permissions`). Writes and creations stop with ENOSPC
while the host filesystem is under `min_free_bytes`.
"""

from __future__ import annotations

import errno
import os
import stat as st
from typing import Any

from .beneath import Root, clean, split

MODE_MASK = 0o1777           # no setuid / setgid on the host
MAX_IO = 1 << 20             # one read's answer (FUSE asks at most max_read)


def attr(s: os.stat_result) -> dict[str, Any]:
    mode = st.S_IFMT(s.st_mode) | (st.S_IMODE(s.st_mode) & MODE_MASK)
    return {"mode": mode, "ino": s.st_ino, "nlink": s.st_nlink, "uid": s.st_uid,
            "gid": s.st_gid, "size": s.st_size, "blocks": s.st_blocks,
            "atime": s.st_atime_ns, "mtime": s.st_mtime_ns, "ctime": s.st_ctime_ns}


def _int(req: dict[str, Any], key: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    value = req.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise OSError(errno.EINVAL, f"bad '{key}'")
    return value


def _path(req: dict[str, Any], key: str = "path") -> str:
    value = req.get(key)
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise OSError(errno.EINVAL, f"bad '{key}'")
    return clean(value)


class VolumeOps:
    """The operations on one volume directory; each returns (result, payload)."""

    def __init__(self, directory: str | os.PathLike[str], *,
                 min_free_bytes: int = 0) -> None:
        self.root = Root(directory)
        self.min_free_bytes = min_free_bytes

    def close(self) -> None:
        self.root.close()

    def gone(self) -> bool:
        """The volume was destroyed (its directory removed) while mounted."""
        return os.fstat(self.root.fd).st_nlink == 0

    def _room(self) -> None:
        v = os.statvfs(self.root.fd)
        if v.f_bavail * v.f_frsize < self.min_free_bytes:
            raise OSError(errno.ENOSPC, "the host's disk is under its floor")

    def _parent(self, path: str) -> tuple[int, str]:
        if path == "/":
            raise OSError(errno.EBUSY, "the volume's root")
        parent, name = split(path)
        return self.root.open_dir(parent), name

    def _at(self, path: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(name, *args, dir_fd=<its parent>, **kwargs)` for the last name of `path`."""
        pfd, name = self._parent(path)
        try:
            return fn(name, *args, dir_fd=pfd, **kwargs)
        finally:
            os.close(pfd)

    def call(self, req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = req.get("op")
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
        if fn is None:
            raise OSError(errno.ENOSYS, f"unknown operation {op!r}")
        return fn(req, payload)  # type: ignore[no-any-return]

    # ---- reading ----------------------------------------------------------------------

    def op_getattr(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        path = _path(req)
        if path == "/":
            return {"attr": attr(os.fstat(self.root.fd))}, b""
        return {"attr": attr(self._at(path, os.stat, follow_symlinks=False))}, b""

    def op_readdir(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        fd = self.root.open_dir(_path(req))
        try:
            return {"names": os.listdir(fd)}, b""
        finally:
            os.close(fd)

    def op_readlink(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        return {"target": self._at(_path(req), os.readlink)}, b""

    def op_read(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        fd = self.root.open(_path(req), os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not st.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            return {}, os.pread(fd, _int(req, "size", 0, MAX_IO), _int(req, "offset"))
        finally:
            os.close(fd)

    def op_statfs(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        v = os.statvfs(self.root.fd)
        return {"bsize": v.f_bsize, "frsize": v.f_frsize, "blocks": v.f_blocks,
                "bfree": v.f_bfree, "bavail": v.f_bavail, "files": v.f_files,
                "ffree": v.f_ffree, "namemax": v.f_namemax}, b""

    # ---- changing ---------------------------------------------------------------------

    def _own(self, pfd: int, name: str, req: dict[str, Any]) -> None:
        os.chown(name, _int(req, "uid", 0, 2**32 - 1), _int(req, "gid", 0, 2**32 - 1),
                 dir_fd=pfd, follow_symlinks=False)

    def op_mkdir(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        self._room()
        pfd, name = self._parent(_path(req))
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
            self._own(pfd, name, req)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
            try:
                os.fchmod(fd, _int(req, "mode", 0, 0o7777) & MODE_MASK)
                return {"attr": attr(os.fstat(fd))}, b""
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def op_create(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        """A regular file: made (mode, owner) if missing; EEXIST if `excl` and present."""
        self._room()
        pfd, name = self._parent(_path(req))
        try:
            flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=pfd)
                made = True
            except FileExistsError:
                if req.get("excl"):
                    raise
                fd, made = os.open(name, flags, dir_fd=pfd), False
            try:
                if made:
                    os.fchown(fd, _int(req, "uid", 0, 2**32 - 1), _int(req, "gid", 0, 2**32 - 1))
                    os.fchmod(fd, _int(req, "mode", 0, 0o7777) & MODE_MASK)
                return {"attr": attr(os.fstat(fd))}, b""
            finally:
                os.close(fd)
        finally:
            os.close(pfd)

    def op_write(self, req: dict[str, Any], data: bytes) -> tuple[dict[str, Any], bytes]:
        self._room()
        fd = self.root.open(_path(req), os.O_WRONLY | os.O_NONBLOCK)
        try:
            offset, view, done = _int(req, "offset"), memoryview(data), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            return {"size": done}, b""
        finally:
            os.close(fd)

    def op_truncate(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        size = _int(req, "size")
        if size:
            self._room()
        fd = self.root.open(_path(req), os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.ftruncate(fd, size)
            return {}, b""
        finally:
            os.close(fd)

    def op_unlink(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        self._at(_path(req), os.unlink)
        return {}, b""

    def op_rmdir(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        self._at(_path(req), os.rmdir)
        return {}, b""

    def op_symlink(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        target = req.get("target")
        if not isinstance(target, str) or not target or len(target) > 4096:
            raise OSError(errno.EINVAL, "bad 'target'")
        self._room()
        pfd, name = self._parent(_path(req))
        try:
            os.symlink(target, name, dir_fd=pfd)   # stored as text; resolved in the guest
            self._own(pfd, name, req)
            return {}, b""
        finally:
            os.close(pfd)

    def _two(self, req: dict[str, Any], fn: Any, **kwargs: Any) -> tuple[dict[str, Any], bytes]:
        src_fd, src = self._parent(_path(req))
        try:
            dst_fd, dst = self._parent(_path(req, "new"))
            try:
                fn(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd, **kwargs)
                return {}, b""
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    def op_rename(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        if req.get("flags"):       # RENAME_NOREPLACE / EXCHANGE: callers fall back
            raise OSError(errno.EINVAL, "rename flags are not supported")
        return self._two(req, os.rename)

    def op_link(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        return self._two(req, os.link, follow_symlinks=False)

    def op_chmod(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        mode = _int(req, "mode", 0, 0o7777) & MODE_MASK
        path = _path(req)
        if path == "/":
            os.fchmod(self.root.fd, mode)
            return {}, b""
        pfd, name = self._parent(path)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=pfd)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            return {}, b""
        finally:
            os.close(pfd)

    def op_chown(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        uid = req.get("uid", -1)
        gid = req.get("gid", -1)
        for v in (uid, gid):
            if not isinstance(v, int) or not -1 <= v < 2**32:
                raise OSError(errno.EINVAL, "bad owner")
        path = _path(req)
        if path == "/":
            os.fchown(self.root.fd, uid, gid)
            return {}, b""
        self._at(path, os.chown, uid, gid, follow_symlinks=False)
        return {}, b""

    def op_utimens(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        times = (_int(req, "atime"), _int(req, "mtime"))
        path = _path(req)
        if path == "/":
            os.utime(self.root.fd, ns=times)
            return {}, b""
        self._at(path, os.utime, ns=times, follow_symlinks=False)
        return {}, b""

    def op_fsync(self, req: dict[str, Any], _: bytes) -> tuple[dict[str, Any], bytes]:
        fd = self.root.open(_path(req), os.O_RDONLY | os.O_NONBLOCK)
        try:
            os.fsync(fd)
            return {}, b""
        finally:
            os.close(fd)
