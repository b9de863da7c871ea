"""Build `EntryInfo` messages from the filesystem (blocking; call via `run_as`).

As E2B's envd builds them (infra `shared/pkg/filesystem/entry.go`, `GetEntryInfo`):
- A symlink reports its target's `type` (file or directory) and permission bits in
  `mode`, and `symlinkTarget` = the absolute, fully resolved target. A link that
  cannot be resolved (dangling, a loop) has `symlinkTarget` = its own path, type
  UNSPECIFIED (the SDKs' `list` drop such entries) and mode 0. `isSymlink` is never
  set (E2B's proto has no such field; the Py SDK would report SYMLINK when it is).
  Size and mtime are the link's own (`lstat`); `metadata` is the target's.
- `metadata` holds the file's `user.e2b.*` extended attributes, prefix stripped.
- `permissions` is Go's `FileMode.String()` of the `lstat` mode (`-rw-r--r--`,
  `drwxr-xr-x`, `Lrwxrwxrwx` for a link, `dtrwxrwxrwx` for a sticky directory);
  `mode` holds the nine permission bits only (Go's `Perm()`).
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


# Go's os.FileMode type letters (FileMode.String), by Linux file type.
_GO_TYPE_LETTERS = {stat.S_IFDIR: "d", stat.S_IFLNK: "L", stat.S_IFBLK: "D", stat.S_IFCHR: "Dc",
                    stat.S_IFIFO: "p", stat.S_IFSOCK: "S"}


def go_mode_string(mode: int) -> str:
    """`mode` (from stat) as Go's `os.FileMode.String()` renders it: type and special-bit
    letters in Go's order (d L D p S u g c t), or "-" when there are none, then rwxrwxrwx."""
    letters = _GO_TYPE_LETTERS.get(stat.S_IFMT(mode), "")
    # Go's letter order is "dalTLDpSugct?": u/g come after the type letters, c after g.
    kind, char_dev = letters.rstrip("c"), letters.endswith("c")
    special = ("u" if mode & stat.S_ISUID else "") + ("g" if mode & stat.S_ISGID else "")
    special += ("c" if char_dev else "") + ("t" if mode & stat.S_ISVTX else "")
    rwx = "".join(ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx"))
    return (kind + special or "-") + rwx


def _resolve_link(path: str) -> tuple[str, os.stat_result | None]:
    """(resolved target, its stat) of symlink `path`; (path, None) when it cannot be
    resolved, as Go's filepath.EvalSymlinks failing falls back to the link's own path."""
    try:
        target = os.path.realpath(path, strict=True)
        return target, os.stat(target)
    except (OSError, ValueError):
        return path, None


def entry_from_stat(path: str, st: os.stat_result) -> EntryInfo:
    """EntryInfo for `path` given its `lstat` result."""
    entry = EntryInfo(
        name=os.path.basename(path) or path,
        type=_file_type(st.st_mode),
        path=path,
        size=st.st_size,
        mode=st.st_mode & 0o777,
        permissions=go_mode_string(st.st_mode),
        owner=_owner(st.st_uid),
        group=_group(st.st_gid),
        modified_time=Timestamp.from_nanos(st.st_mtime_ns),
    )
    if stat.S_ISLNK(st.st_mode):
        target, target_st = _resolve_link(path)
        entry.symlink_target = target
        if target_st is None:
            entry.type, entry.mode = FileType.UNSPECIFIED, 0
        else:
            entry.type, entry.mode = _file_type(target_st.st_mode), target_st.st_mode & 0o777
    metadata = read_metadata(path)  # follows a link, as E2B's xattr.List does
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
