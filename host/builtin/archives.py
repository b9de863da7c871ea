"""COPY archives of built-in templates: a directory as an uncompressed tar, and digests.

Uncompressed on purpose: the build VM unpacks it under TCG, where gunzip of a few
hundred MB costs more than moving the bytes; the archive only crosses the host's own
loopback. Members are sorted and carry no host user or group names, so one tree always
gives the same archive.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path, mode and content under `root` (sorted)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.is_dir():
            continue
        rel = path.relative_to(root).as_posix()
        h.update(f"{rel}\0{path.lstat().st_mode:o}\0".encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        else:
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def write_tar(src: Path, arcname: str, dest: Path, *, keep_pycache: bool = True) -> None:
    """`src` as `arcname/...` in a new tar at `dest` (written to a temp name, renamed;
    blocking). Without `keep_pycache`, byte-code caches are left out."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if not keep_pycache and "__pycache__" in info.name.split("/"):
            return None
        return _clean(info)

    try:
        with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
            tar.add(src, arcname=arcname, recursive=False, filter=keep)
            for path in sorted(src.rglob("*")):
                tar.add(path, arcname=f"{arcname}/{path.relative_to(src).as_posix()}",
                        recursive=False, filter=keep)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
