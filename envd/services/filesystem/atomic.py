"""All-or-nothing file writes for uploads (blocking; call via `run_as`).

An upload goes to a hidden temp file next to its destination and is renamed over
it only once every byte arrived, so an aborted or failed upload (client gone,
bad gzip, disk full) leaves no partial file and the previous content intact.
Mode and non-metadata `user.*` xattrs of a replaced file are carried over.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from .entry import METADATA_XATTR_PREFIX, UPLOAD_TEMP_PREFIX
from .operations import make_dirs

_NAME_MAX = 255
_IOV_MAX = 1024


def is_upload_temp(name: str) -> bool:
    return os.path.basename(name).startswith(UPLOAD_TEMP_PREFIX)


class PendingFile:
    """A temp file that becomes `destination` on `commit()` or vanishes on `abort()`."""

    def __init__(self, destination: str, temp_path: str, fd: int, replaced: bool) -> None:
        self.destination = destination
        self.temp_path = temp_path
        self._fd: int | None = fd
        self._replaced = replaced
        self.size = 0

    @classmethod
    def open(cls, destination: str) -> PendingFile:
        """Start an upload to `destination`; a symlink there is written through, not replaced."""
        if not os.path.basename(destination):
            raise IsADirectoryError(errno.EISDIR, "path is a directory", destination)
        if os.path.islink(destination):
            destination = os.path.realpath(destination)
        parent, base = os.path.split(destination)
        make_dirs(parent)
        mode = 0o644
        replaced = False
        try:
            st = os.stat(destination)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "path is a directory", destination)
            mode, replaced = stat.S_IMODE(st.st_mode), True
        name = f"{UPLOAD_TEMP_PREFIX}{secrets.token_hex(8)}-{base}"[:_NAME_MAX]
        temp_path = os.path.join(parent, name)
        fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        if mode != 0o644:
            os.fchmod(fd, mode)  # the umask must not narrow a replaced file's mode
        return cls(destination, temp_path, fd, replaced)

    def write(self, chunks: list[bytes]) -> None:
        """Append `chunks` in order (one writev per batch: no joining copy)."""
        if self._fd is None:
            raise ValueError("upload already finished")
        pending = [memoryview(c) for c in chunks if c]
        while pending:
            batch = pending[:_IOV_MAX]
            n = os.writev(self._fd, batch)
            self.size += n
            # Drop what was written; a partial write leaves the rest of one buffer.
            while n and pending:
                if n >= len(pending[0]):
                    n -= len(pending.pop(0))
                else:
                    pending[0] = pending[0][n:]
                    n = 0

    def _copy_xattrs(self) -> None:
        try:
            names = os.listxattr(self.destination)
        except OSError:
            return
        for name in names:
            # the metadata set belongs to the content: a write replaces it with the one it
            # brings, or with none (E2B parity, issue 14 item 4); other user xattrs stay
            if not name.startswith("user.") or name.startswith(METADATA_XATTR_PREFIX):
                continue
            try:
                os.setxattr(self.temp_path, name, os.getxattr(self.destination, name))
            except OSError:
                pass

    def commit(self, metadata: dict[str, str] | None) -> None:
        """Publish the file; `metadata` replaces the prior user.e2b.* set (None clears it)."""
        if self._fd is None:
            raise ValueError("upload already finished")
        fd, self._fd = self._fd, None
        try:
            os.close(fd)
            if self._replaced:
                self._copy_xattrs()
            for key, value in (metadata or {}).items():
                os.setxattr(self.temp_path, METADATA_XATTR_PREFIX + key, value.encode("ascii"))
            os.rename(self.temp_path, self.destination)
        except BaseException:
            self._unlink()
            raise

    def abort(self) -> None:
        """Drop the temp file; safe to call more than once and after commit."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.temp_path)
        except FileNotFoundError:
            pass
