"""Build `EntryInfo` messages from the filesystem (blocking; call via `run_as`).

- Symlinks are reported as `FILE_TYPE_SYMLINK` with `isSymlink` and the absolute,
  fully resolved `symlinkTarget` (JS looks only at `type`, Py at `isSymlink`).
  Size, mode and mtime of a symlink are the link's own (`lstat`).
- `metadata` holds the file's `user.e2b.*` extended attributes, prefix stripped.
- `permissions` is the `ls -l` style string (`-rw-r--r--`); `mode` the permission bits.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

from protobuf.wkt import Timestamp

from ...spec.filesystem.filesystem_pb import EntryInfo, FileType

METADATA_XATTR_PREFIX = "user.e2b."
# Hidden temp files of uploads in progress (atomic.py); listings and watches skip them.
UPLOAD_TEMP_PREFIX = ".envd-upload-"


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _file_type(mode: int) -> FileType:
    if stat.S_ISLNK(mode):
        return FileType.SYMLINK
    if stat.S_ISDIR(mode):
        return FileType.DIRECTORY
    # Regular files and everything else that holds data (fifos, devices) read as files.
    return FileType.FILE


def read_metadata(path: str) -> dict[str, str]:
    """`user.e2b.*` xattrs of `path` (following symlinks), prefix stripped."""
    try:
        names = os.listxattr(path)
    except OSError:
        return {}
    metadata: dict[str, str] = {}
    for name in names:
        if not name.startswith(METADATA_XATTR_PREFIX):
            continue
        try:
            value = os.getxattr(path, name)
        except OSError:
            continue
        metadata[name[len(METADATA_XATTR_PREFIX):]] = value.decode("utf-8", "replace")
    return metadata


def write_metadata(path: str, metadata: dict[str, str]) -> None:
    """Replace the `user.e2b.*` xattrs of `path` with `metadata` (keys already lowercased)."""
    for name in os.listxattr(path):
        if name.startswith(METADATA_XATTR_PREFIX) and name[len(METADATA_XATTR_PREFIX):] not in metadata:
            try:
                os.removexattr(path, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
    for key, value in metadata.items():
        os.setxattr(path, METADATA_XATTR_PREFIX + key, value.encode("ascii"))


def entry_from_stat(path: str, st: os.stat_result) -> EntryInfo:
    """EntryInfo for `path` given its `lstat` result."""
    entry = EntryInfo(
        name=os.path.basename(path) or path,
        type=_file_type(st.st_mode),
        path=path,
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        permissions=stat.filemode(st.st_mode),
        owner=_owner(st.st_uid),
        group=_group(st.st_gid),
        modified_time=Timestamp.from_nanos(st.st_mtime_ns),
    )
    if stat.S_ISLNK(st.st_mode):
        entry.is_symlink = True
        entry.symlink_target = os.path.realpath(path)
    else:
        metadata = read_metadata(path)
        if metadata:
            entry.metadata = metadata
    return entry


def build_entry(path: str) -> EntryInfo:
    """EntryInfo for `path` (not following a final symlink). Raises OSError."""
    return entry_from_stat(path, os.lstat(path))


def list_entries(root: str, depth: int) -> list[EntryInfo]:
    """Entries below directory `root`, up to `depth` levels, in lexical walk order.

    Symlinked directories are listed but not descended into. Entries that vanish
    during the walk are skipped; a subdirectory we may not read is listed without
    its children (like upstream's WalkDir, which skips unreadable dirs).
    """
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"path '{root}' is not a directory")
    entries: list[EntryInfo] = []

    def walk(directory: str, level: int, strict: bool) -> None:
        try:
            with os.scandir(directory) as it:
                children = sorted(it, key=lambda d: d.name)
        except OSError:
            if strict:
                raise
            return
        for child in children:
            if child.name.startswith(UPLOAD_TEMP_PREFIX):
                continue
            try:
                child_st = child.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            entries.append(entry_from_stat(child.path, child_st))
            if level < depth and stat.S_ISDIR(child_st.st_mode):
                walk(child.path, level + 1, strict=False)

    walk(root, 1, strict=True)
    return entries
