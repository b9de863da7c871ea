"""`VolumeFS`: a mounted volume, each FUSE operation one request to the host (client.py).

Stateless on purpose (as NFSv3): no file handles are held on the host, every operation
names its path, so nothing is lost when the connection breaks across a pause, resume or
fork. The kernel caches no attributes or names (timeouts 0, set by mount.py): another
sandbox's write is seen at the next operation, as E2B's NFS mounts with noac.
"""

from __future__ import annotations

import errno
import os
import time
from typing import Any

import mfusepy as fuse  # type: ignore[import-untyped]

from .client import HostClient, RemoteError

MAX_IO = 1 << 20
_ATTRS = {"mode": "st_mode", "ino": "st_ino", "nlink": "st_nlink", "uid": "st_uid",
          "gid": "st_gid", "size": "st_size", "blocks": "st_blocks", "atime": "st_atime",
          "mtime": "st_mtime", "ctime": "st_ctime"}


def _caller() -> tuple[int, int]:
    uid, gid, _pid = fuse.fuse_get_context()
    return uid, gid


class VolumeFS(fuse.Operations):
    use_ns = True      # times as integer nanoseconds both ways

    def __init__(self, client: HostClient) -> None:
        self.client = client

    def init_with_config(self, conn: Any, config: Any) -> None:
        """1 MiB per read and write (each a round trip to the host), 4 MiB read ahead:
        the kernel caps them at what it supports."""
        if conn is not None:
            conn.max_write = MAX_IO
            if hasattr(conn, "max_read"):   # libfuse 3: must match mount.py's max_read
                conn.max_read = MAX_IO
            conn.max_readahead = 4 * MAX_IO

    def _call(self, op: str, path: str, payload: bytes = b"",
              **args: Any) -> tuple[dict[str, Any], bytes]:
        try:
            return self.client.call(op, path, payload, **args)
        except RemoteError as exc:
            raise fuse.FuseOSError(exc.errno or errno.EIO) from None

    # ---- reading ----------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        attr = self._call("getattr", path)[0]["attr"]
        out = {_ATTRS[k]: v for k, v in attr.items() if k in _ATTRS}
        out["st_blksize"] = 1 << 20   # large reads and writes (cp and friends use it)
        return out

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *self._call("readdir", path)[0]["names"]]

    def readlink(self, path: str) -> str:
        return str(self._call("readlink", path)[0]["target"])

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return self._call("read", path, size=min(size, MAX_IO), offset=offset)[1]

    def statfs(self, path: str) -> dict[str, Any]:
        s = self._call("statfs", path)[0]
        return {"f_bsize": s["bsize"], "f_frsize": s["frsize"], "f_blocks": s["blocks"],
                "f_bfree": s["bfree"], "f_bavail": s["bavail"], "f_files": s["files"],
                "f_ffree": s["ffree"], "f_namemax": s["namemax"]}

    def open(self, path: str, flags: int) -> int:
        return 0

    def opendir(self, path: str) -> int:
        return 0

    # ---- changing ---------------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int = 0) -> int:
        uid, gid = _caller()
        self._call("create", path, mode=mode & 0o7777, uid=uid, gid=gid,
                   excl=bool(flags & os.O_EXCL))
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        uid, gid = _caller()
        self._call("mkdir", path, mode=mode & 0o7777, uid=uid, gid=gid)
        return 0

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return int(self._call("write", path, bytes(data), offset=offset)[0]["size"])

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._call("truncate", path, size=length)
        return 0

    def unlink(self, path: str) -> int:
        self._call("unlink", path)
        return 0

    def rmdir(self, path: str) -> int:
        self._call("rmdir", path)
        return 0

    def symlink(self, target: str, source: str) -> int:
        uid, gid = _caller()   # mfusepy: `target` is the new link, `source` its text
        self._call("symlink", target, target=source, uid=uid, gid=gid)
        return 0

    def rename(self, old: str, new: str) -> int:
        self._call("rename", old, new=new)
        return 0

    def link(self, target: str, source: str) -> int:
        self._call("link", source, new=target)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._call("chmod", path, mode=mode & 0o7777)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._call("chown", path, uid=_owner(uid), gid=_owner(gid))
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        now = time.time_ns()
        atime, mtime = times if times is not None else (now, now)
        self._call("utimens", path, atime=int(atime), mtime=int(mtime))
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._call("fsync", path)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        return 0


def _owner(value: int) -> int:
    """FUSE passes "unchanged" as the all-ones id."""
    return -1 if value in (-1, 0xFFFFFFFF) else value
