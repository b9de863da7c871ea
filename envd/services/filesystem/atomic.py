"""All-or-nothing file writes for uploads (blocking; call on the filesystem pool).

An upload goes to a hidden temp file next to its destination and is renamed over
it only once every byte arrived, so an aborted or failed upload (client gone,
bad gzip, disk full) leaves no partial file and the previous content intact.
Mode and non-metadata `user.*` xattrs of a replaced file are carried over.

Uploads run with envd's own rights and give what they create to the requesting
user, as E2B's envd does (`api/upload.go` `processFile`, `permissions.EnsureDirs`):
missing parent directories are made (0755) and chowned to the user, the file is the
user's. `publish_all` publishes the files of one request together or not at all;
`PendingFile.abort` also removes the directories the upload made.

The temp file's name carries what E2B's envd would have done to the destination
(new or replaced, empty, metadata written) so that watchers can report the events
E2B's in-place write produces (watch.py, `UploadTraits`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from dataclasses import dataclass

from .entry import METADATA_XATTR_PREFIX, UPLOAD_TEMP_PREFIX
from .operations import DIR_MODE

_NAME_MAX = 255
_IOV_MAX = 1024

Owner = tuple[int, int] | None  # (uid, gid) to chown to; None: leave as created


def is_upload_temp(name: str) -> bool:
    return os.path.basename(name).startswith(UPLOAD_TEMP_PREFIX)


@dataclass(frozen=True)
class UploadTraits:
    """What writing the destination in place (E2B) would have done, beyond creating it."""

    replaced: bool = False  # the destination existed (else: created)
    empty: bool = False     # no byte was written to a created file
    metadata: bool = False  # user.e2b.* xattrs were written or removed

    def flags(self) -> str:
        return ("r" if self.replaced else "n") + ("e" if self.empty else "") \
            + ("m" if self.metadata else "")

    @classmethod
    def parse(cls, name: str) -> UploadTraits:
        """Traits from a temp file name (`<prefix><token>-<flags>-<base>`)."""
        _token, _, rest = os.path.basename(name)[len(UPLOAD_TEMP_PREFIX):].partition("-")
        flags, _, _base = rest.partition("-")
        return cls(replaced="r" in flags, empty="e" in flags, metadata="m" in flags)


def _temp_name(base: str, traits: UploadTraits) -> str:
    return f"{UPLOAD_TEMP_PREFIX}{secrets.token_hex(8)}-{traits.flags()}-{base}"[:_NAME_MAX]


def ensure_dirs(path: str, owner: Owner) -> list[str]:
    """`mkdir -p path`, each directory made chowned to `owner`; returns those made,
    outermost first. A non-directory in the way is ENOTDIR."""
    missing: list[str] = []
    probe = path
    while True:
        try:
            st = os.stat(probe)
        except FileNotFoundError:
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                raise
            probe = parent
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "a path component is not a directory", probe)
        break
    made: list[str] = []
    try:
        for directory in reversed(missing):
            try:
                os.mkdir(directory, DIR_MODE)
            except FileExistsError:
                continue  # made by someone else meanwhile: not ours to chown or remove
            made.append(directory)
            if owner is not None:
                os.chown(directory, *owner)
    except BaseException:
        remove_dirs(made)
        raise
    return made


def remove_dirs(made: list[str]) -> None:
    """Remove directories `ensure_dirs` made, innermost first, if still empty."""
    for directory in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(directory)


class PendingFile:
    """A temp file that becomes `destination` on `publish()` or vanishes on `abort()`."""

    def __init__(self, destination: str, temp_path: str, fd: int, traits: UploadTraits,
                 made_dirs: list[str]) -> None:
        self.destination = destination
        self.temp_path = temp_path
        self._fd: int | None = fd
        self.traits = traits
        self.made_dirs = made_dirs
        self.size = 0
        self._backup: str | None = None
        self._published = False

    @property
    def replaced(self) -> bool:
        return self.traits.replaced

    @classmethod
    def open(cls, destination: str, *, owner: Owner = None,
             metadata: dict[str, str] | None = None) -> PendingFile:
        """Start an upload to `destination`; a symlink there is written through, not replaced.

        `owner` gets the file and the parent directories made for it; `metadata` is the
        request's metadata set (only whether writing it changes anything matters here).
        """
        if not os.path.basename(destination):
            raise IsADirectoryError(errno.EISDIR, "path is a directory", destination)
        if os.path.islink(destination):
            destination = os.path.realpath(destination)
        parent, base = os.path.split(destination)
        made = ensure_dirs(parent, owner)
        try:
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
            traits = UploadTraits(replaced=replaced, metadata=bool(metadata) or (
                replaced and _has_metadata(destination)))
            temp_path = os.path.join(parent, _temp_name(base, traits))
            fd = os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except BaseException:
            remove_dirs(made)
            raise
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            if mode != 0o644:
                # after the chown, which clears set-id bits: the umask must not narrow, nor
                # the chown strip, a replaced file's mode
                os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp_path)
            remove_dirs(made)
            raise
        return cls(destination, temp_path, fd, traits, made)

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

    def seal(self, metadata: dict[str, str] | None) -> None:
        """Finish the temp file (content, xattrs, `metadata` replacing the prior user.e2b.*
        set); nothing is visible at the destination yet."""
        if self._fd is None:
            raise ValueError("upload already finished")
        fd, self._fd = self._fd, None
        try:
            os.close(fd)
            if self.replaced:
                self._copy_xattrs()
            for key, value in (metadata or {}).items():
                os.setxattr(self.temp_path, METADATA_XATTR_PREFIX + key, value.encode("ascii"))
            if not self.replaced and self.size == 0:
                # E2B writes no byte to a new empty file: no WRITE event (see module doc).
                self.traits = UploadTraits(empty=True, metadata=self.traits.metadata)
                renamed = os.path.join(os.path.dirname(self.temp_path),
                                       _temp_name(os.path.basename(self.destination),
                                                  self.traits))
                os.rename(self.temp_path, renamed)
                self.temp_path = renamed
        except BaseException:
            self._unlink(self.temp_path)
            raise

    def publish(self, *, keep_backup: bool = False) -> None:
        """Rename the sealed temp file over the destination. With `keep_backup`, a replaced
        destination stays reachable for `roll_back()` until `drop_backup()`."""
        if keep_backup and self.replaced:
            backup = os.path.join(os.path.dirname(self.temp_path),
                                  _temp_name(os.path.basename(self.destination),
                                             UploadTraits(replaced=True)))
            with contextlib.suppress(FileNotFoundError):
                os.link(self.destination, backup)
                self._backup = backup
        os.rename(self.temp_path, self.destination)
        self._published = True

    def roll_back(self) -> None:
        """Undo `publish()`: the previous file comes back, or a created one goes."""
        if not self._published:
            return
        self._published = False
        if self._backup is not None:
            backup, self._backup = self._backup, None
            os.rename(backup, self.destination)
        else:
            self._unlink(self.destination)

    def drop_backup(self) -> None:
        if self._backup is not None:
            backup, self._backup = self._backup, None
            self._unlink(backup)

    def commit(self, metadata: dict[str, str] | None) -> None:
        """Seal and publish this one file."""
        self.seal(metadata)
        self.publish()

    def abort(self) -> None:
        """Drop the temp file and the directories made for it; safe to call more than
        once and after publish (then only directories left empty go)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if not self._published:
            self._unlink(self.temp_path)
            remove_dirs(self.made_dirs)

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _has_metadata(path: str) -> bool:
    try:
        return any(n.startswith(METADATA_XATTR_PREFIX) for n in os.listxattr(path))
    except OSError:
        return False


class PublishError(Exception):
    """Publishing file number `index` of an upload failed with `cause`; none is published."""

    def __init__(self, index: int, cause: OSError) -> None:
        super().__init__(str(cause))
        self.index = index
        self.cause = cause


def publish_all(files: list[PendingFile], metadata: dict[str, str] | None) -> None:
    """Publish every file of one upload, or none: every file is sealed before the first
    rename, and renames done before a failing one are rolled back. Raises PublishError."""
    for index, pending in enumerate(files):
        try:
            pending.seal(metadata)
        except OSError as exc:
            raise PublishError(index, exc) from exc
    several = len(files) > 1
    done: list[PendingFile] = []
    try:
        for index, pending in enumerate(files):
            try:
                pending.publish(keep_backup=several)
            except OSError as exc:
                for published in reversed(done):
                    with contextlib.suppress(OSError):
                        published.roll_back()
                raise PublishError(index, exc) from exc
            done.append(pending)
    finally:
        for pending in files:
            pending.drop_backup()
