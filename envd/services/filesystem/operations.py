"""Blocking filesystem operations behind the unary RPCs (call via `run_as`).

Each helper takes resolved absolute paths, raises OSError (mapped in errors.py)
and runs with the requesting user's credentials, so whatever it creates is the
user's and whatever the user may not touch fails with EACCES.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from ...spec.filesystem.filesystem_pb import EntryInfo
from .entry import build_entry

DIR_MODE = 0o755


def make_dirs(path: str) -> None:
    """Create `path` and missing parents (like `mkdir -p`, but a file in the way is ENOTDIR)."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)


def make_dir(path: str) -> EntryInfo:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(st.st_mode):
            raise FileExistsError(errno.EEXIST, "directory already exists", path)
        raise NotADirectoryError(errno.ENOTDIR, "path already exists but is not a directory", path)
    make_dirs(path)
    return build_entry(path)


def move(source: str, destination: str) -> EntryInfo:
    os.lstat(source)  # a missing source must be not_found, not a parent-creation error
    parent = os.path.dirname(destination)
    if parent:
        make_dirs(parent)
    try:
        os.rename(source, destination)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.move(source, destination)
    return build_entry(destination)


def remove(path: str) -> None:
    """Remove a file, link or directory tree. A path that does not exist is already
    removed: no error, as E2B's envd (its os.RemoveAll) answers."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def stat_entry(path: str) -> EntryInfo:
    return build_entry(path)
