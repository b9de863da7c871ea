#!/usr/bin/env python3
"""Apply one OCI image layer (a tar changeset) onto a root directory.

    python3 apply.py [--diff-id sha256:HEX] LAYER TARGET_DIR

Standalone (Python 3.11 stdlib, with layertar.py and rootdir.py beside it): run by
host/images/confined.py (the host-side importer's confined helper, as root of a user
namespace); tests import it. LAYER: a plain or gzip tar (found from its first bytes) or
`-` for stdin; the host decompresses zstd layers first (`host.images.open_layer`).

Semantics (OCI image spec, "Applying Changesets"; what containerd does): `.wh.NAME`
deletes NAME below (never created itself); `.wh..wh..opq` hides what the layers below put
in its directory (neither hides what this layer adds, in any order). A non-directory
replaces what is at its path; a directory over a directory updates metadata only. Hard
links, symlinks, devices and fifos as such; numeric owners, modes (setuid/setgid/sticky),
ns mtimes and xattrs (PAX `SCHILY.xattr.*`, `LIBARCHIVE.xattr.*`); directory metadata
last. Nothing is written outside TARGET_DIR: names made relative, `..` cannot climb above
the root, symlinks resolve as if TARGET_DIR were `/`, the last component is never
followed (O_NOFOLLOW, *at() calls). Without root (tests) owners and devices are skipped
with a warning.

The uncompressed tar's sha256 (the diff id) is checked against --diff-id: a mismatch exits
3 (discard the result). Prints one JSON line {"diff_id", "entries", ..., "warnings"}.
Exit status: 0 applied, 1 invalid layer or I/O error, 2 usage, 3 diff id mismatch.
"""

from __future__ import annotations

import argparse
import errno
import gzip
import io
import json
import os
import shutil
import stat
import sys
import tarfile
import zlib
from collections.abc import Callable
from typing import IO, Any, TypeVar

try:  # run as a script beside layertar.py and rootdir.py (the helper)
    from layertar import (  # type: ignore[import-not-found,unused-ignore]
        AUFS_META,
        CHUNK,
        OPAQUE,
        WHITEOUT,
        ApplyError,
        DiffIdMismatch,
        Hashing,
        check_diff_id,
        clean_name,
        entry_bytes,
        entry_times,
        entry_xattrs,
        open_layer,
    )
    from rootdir import Root, RPath  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    from host.images.layertar import (
        AUFS_META,
        CHUNK,
        OPAQUE,
        WHITEOUT,
        ApplyError,
        DiffIdMismatch,
        Hashing,
        check_diff_id,
        clean_name,
        entry_bytes,
        entry_times,
        entry_xattrs,
        open_layer,
    )
    from host.images.rootdir import Root, RPath

MAX_WARNINGS = 50
_T = TypeVar("_T")


class Applier:
    """Applies the entries of one layer tar, in order, onto a root directory."""

    def __init__(self, target: str, max_bytes: int | None = None) -> None:
        self.root = Root(target)
        self.max_bytes, self.spent = max_bytes, 0
        self.privileged = os.geteuid() == 0
        # root of a user namespace (the host-side importer, host/images/confined.py) owns
        # files but may not make device nodes: those are skipped with a warning
        self.devices = self.privileged and not _in_user_namespace()
        self.created: set[RPath] = set()   # what this layer wrote (resolved paths)
        self.touched: set[RPath] = set()   # ... and every directory above those
        self.dirs: dict[RPath, tarfile.TarInfo] = {}  # modes/mtimes to set at the end
        self.counts = {"entries": 0, "files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0,
                       "devices": 0, "fifos": 0, "whiteouts": 0, "opaque": 0, "bytes": 0,
                       "neutralised": 0, "skipped": 0, "unowned": 0}
        self.warnings: list[str] = []
        self.warnings_total = 0

    def close(self) -> None:
        self.root.close()

    def warn(self, message: str) -> None:
        self.warnings_total += 1
        if len(self.warnings) < MAX_WARNINGS:
            self.warnings.append(message)

    # --- entries ---------------------------------------------------------------------

    def entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        self.counts["entries"] += 1
        parts, escaped = clean_name(member.name)
        if escaped:
            self.counts["neutralised"] += 1
            self.warn(f"{member.name!r}: made relative to the root")
        if not parts:
            return  # the root itself: its metadata stays the target's
        if any(p.startswith(AUFS_META) and p != OPAQUE for p in parts):
            self.counts["skipped"] += 1
            return  # aufs bookkeeping (.wh..wh.plnk, .wh..wh.aufs)
        name = parts[-1]
        try:
            if name == OPAQUE:
                self.opaque(parts[:-1])
            elif name.startswith(WHITEOUT):
                self.whiteout(parts[:-1], name[len(WHITEOUT):])
            else:
                self.create(tar, member, parts)
        except OSError as exc:
            raise ApplyError(f"{member.name}: {exc}") from exc

    def _mark(self, path: RPath) -> None:
        self.created.add(path)
        for i in range(len(path)):
            self.touched.add(path[:i])

    def _parent(self, parts: list[str]) -> tuple[RPath, int]:
        made: list[RPath] = []
        parent = self.root.resolve_dir(parts[:-1], create=True, made=made)
        if parent is None:  # create=True never returns None
            raise ApplyError(f"cannot resolve {'/'.join(parts)}")
        for path in made:
            self.touched.add(path)
        return parent, self.root.open_real(parent)

    def _spend(self, m: tarfile.TarInfo) -> None:
        """Count what the entry takes on a filesystem (whole blocks); past `max_bytes` the
        layer cannot fit the image it is for, refused before its data lands (a sparse
        10 GiB file included: tar hands its holes back as zeros)."""
        if self.max_bytes is None:
            return
        self.spent += entry_bytes(m)
        if self.spent > self.max_bytes:
            raise ApplyError(f"{m.name}: No space left on device (the layer needs more than "
                             f"the image's {self.max_bytes >> 20} MiB)")

    def create(self, tar: tarfile.TarFile, m: tarfile.TarInfo, parts: list[str]) -> None:
        self._spend(m)
        parent, pfd = self._parent(parts)
        name = parts[-1]
        path = parent + (name,)
        try:
            if m.isdir():
                self._make_dir(pfd, name, m)
                self.dirs[path] = m
                self.counts["dirs"] += 1
            elif m.isreg():
                self._write_file(tar, pfd, name, m)
                self.counts["files"] += 1
            elif m.issym():
                self._replacing(pfd, name, lambda: os.symlink(m.linkname, name, dir_fd=pfd))
                self._metadata(pfd, name, m, chmod=False)
                self.counts["symlinks"] += 1
            elif m.islnk():
                if not self._hardlink(pfd, name, path, m):
                    return
                self.counts["hardlinks"] += 1
            elif m.ischr() or m.isblk() or m.isfifo():
                if not self._make_node(pfd, name, m):
                    return
            else:
                self.counts["skipped"] += 1
                self.warn(f"{m.name!r}: tar entry type {m.type!r} is not supported, skipped")
                return
        finally:
            os.close(pfd)
        self._mark(path)

    def _replacing(self, pfd: int, name: str, make: Callable[[], _T]) -> _T:
        """`make()` the new entry at `name`; what is there already (a lower layer's, or
        this one's) is removed first. Most names are new: the create is tried before any
        stat, each call being a round trip through fuse2fs."""
        try:
            return make()
        except FileExistsError:
            self._remove(pfd, name)
            return make()

    def _remove(self, pfd: int, name: str, *, keep_dir: bool = False) -> bool:
        """Remove what is at `name`; returns True if it is a directory that was kept."""
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            self.root.forget()
            shutil.rmtree(name, dir_fd=pfd)
        else:
            os.unlink(name, dir_fd=pfd)
        return False

    def _make_dir(self, pfd: int, name: str, m: tarfile.TarInfo) -> None:
        if not self._remove(pfd, name, keep_dir=True):
            os.mkdir(name, 0o700, dir_fd=pfd)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=pfd)
        try:
            self._chown(fd, None, m)
            self._xattrs(fd, None, m)
        finally:
            os.close(fd)

    def _write_file(self, tar: tarfile.TarFile, pfd: int, name: str,
                    m: tarfile.TarInfo) -> None:
        mode = m.mode & 0o7777
        fd = self._replacing(pfd, name, lambda: os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            mode & 0o777, dir_fd=pfd))
        try:
            # owner and mode as created, from the attributes the create answered with (no
            # round trip): the entry's mode less the umask and the set-id bits
            st = os.fstat(fd)
            src = tar.extractfile(m)
            if src is not None:
                with src:  # os.write: a file object over the fd would fstat it first
                    while chunk := src.read(CHUNK):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view):]
            self.counts["bytes"] += m.size
            # chown first: it clears setuid/setgid bits and security.capability
            chowned = self._chown(fd, None, m, st)
            self._xattrs(fd, None, m)
            if chowned or stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)
            os.utime(fd, ns=entry_times(m))
        finally:
            os.close(fd)

    def _hardlink(self, pfd: int, name: str, path: RPath, m: tarfile.TarInfo) -> bool:
        target, escaped = clean_name(m.linkname)
        if escaped:
            self.counts["neutralised"] += 1
            self.warn(f"{m.name!r}: link target {m.linkname!r} made relative to the root")
        if not target:
            raise ApplyError(f"{m.name}: hard link to the root directory")
        tparent = self.root.resolve_dir(target[:-1], create=False)
        if tparent is None:
            raise ApplyError(f"{m.name}: hard link target {m.linkname} does not exist")
        if tparent + (target[-1],) == path:
            return False  # a link to itself: nothing to do
        tfd = self.root.open_real(tparent)
        try:
            try:
                st = os.stat(target[-1], dir_fd=tfd, follow_symlinks=False)
            except FileNotFoundError:
                raise ApplyError(f"{m.name}: hard link target {m.linkname} does not "
                                 "exist") from None
            if stat.S_ISDIR(st.st_mode):
                raise ApplyError(f"{m.name}: hard link target {m.linkname} is a directory")
            self._remove(pfd, name)
            os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(tfd)
        return True

    def _make_node(self, pfd: int, name: str, m: tarfile.TarInfo) -> bool:
        if m.isfifo():
            kind, dev, counter = stat.S_IFIFO, 0, "fifos"
        else:
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            dev, counter = os.makedev(m.devmajor, m.devminor), "devices"
        self._remove(pfd, name)
        try:
            os.mknod(name, kind | 0o600, dev, dir_fd=pfd)
        except PermissionError:
            if self.devices:
                raise
            self.counts["skipped"] += 1
            self.warn(f"{m.name!r}: device node skipped (no right to make devices here)")
            return False
        self._metadata(pfd, name, m, chmod=True)
        self.counts[counter] += 1
        return True

    # --- metadata --------------------------------------------------------------------

    def _metadata(self, pfd: int, name: str, m: tarfile.TarInfo, *, chmod: bool) -> None:
        """Owner, xattrs, mode and times of a node that cannot be opened (symlink, device,
        fifo): through its name in `pfd`, never following it."""
        self._chown(pfd, name, m)
        self._xattrs(pfd, name, m)
        if chmod:  # the node was just made here by mknod, so it is not a symlink
            os.chmod(name, m.mode & 0o7777, dir_fd=pfd)
        os.utime(name, ns=entry_times(m), dir_fd=pfd, follow_symlinks=False)

    def _chown(self, fd: int, name: str | None, m: tarfile.TarInfo,
               st: os.stat_result | None = None) -> bool:
        """The entry's owner on the fd (or `name` in it); whether it changed. A chown to
        the owner it has is skipped: each call is a round trip through fuse2fs, while the
        stat is answered from the attributes the kernel keeps since the node was made or
        looked up (and what a chown would clear, set-id bits or capabilities, is set
        after this)."""
        if not self.privileged:
            if m.uid != os.geteuid() or m.gid != os.getegid():
                self.counts["unowned"] += 1
            return False
        if st is None:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False) if name else os.fstat(fd)
        if (st.st_uid, st.st_gid) == (m.uid, m.gid):
            return False
        if name is None:
            os.fchown(fd, m.uid, m.gid)
        else:
            os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
        return True

    def _xattrs(self, fd: int, name: str | None, m: tarfile.TarInfo) -> None:
        attrs = entry_xattrs(m)
        if not attrs:
            return
        # an fd for files and directories; for nodes opened through /proc/self/fd so the
        # directory fd anchors the lookup and the last component is not followed
        for key, value in attrs.items():
            try:
                if name is None:
                    os.setxattr(fd, key, value)
                else:
                    os.setxattr(f"/proc/self/fd/{fd}/{name}", key, value,
                                follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM,
                                     errno.EACCES, errno.EINVAL, errno.ENOENT):
                    raise
                self.warn(f"{m.name!r}: xattr {key} not set: {exc.strerror}")

    def finish_dirs(self) -> None:
        """Modes and mtimes of this layer's directories, deepest first."""
        for path in sorted(self.dirs, key=len, reverse=True):
            m = self.dirs[path]
            try:
                fd = self.root.open_real(path)
            except OSError:
                continue  # removed or replaced later in this layer
            try:
                os.fchmod(fd, m.mode & 0o7777)
                os.utime(fd, ns=entry_times(m))
            finally:
                os.close(fd)

    # --- whiteouts -------------------------------------------------------------------

    def whiteout(self, dir_parts: list[str], name: str) -> None:
        self.counts["whiteouts"] += 1
        if name in ("", ".", "..") or "/" in name:
            self.warn(f"whiteout {name!r} in {'/'.join(dir_parts) or '/'} ignored")
            return
        parent = self.root.resolve_dir(dir_parts, create=False)
        if parent is None:
            return  # nothing below to hide
        path = parent + (name,)
        if path in self.created:
            return  # this layer's own entry: only a later layer can hide it
        if path in self.touched:
            self._purge(path)  # a lower directory this layer added to: hide only the lower part
            return
        pfd = self.root.open_real(parent)
        try:
            self._remove(pfd, name)
        finally:
            os.close(pfd)

    def opaque(self, dir_parts: list[str]) -> None:
        self.counts["opaque"] += 1
        made: list[RPath] = []
        parent = self.root.resolve_dir(dir_parts, create=True, made=made)
        if parent is None:
            return
        for path in made:
            self.touched.add(path)
        self.touched.add(parent)
        self._purge(parent)

    def _purge(self, path: RPath) -> None:
        """Remove everything under `path` that this layer did not write."""
        fd = self.root.open_real(path)
        try:
            for name in os.listdir(fd):
                child = path + (name,)
                if child in self.created or child in self.touched:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        self._purge(child)
                    continue
                self._remove(fd, name)
        finally:
            os.close(fd)


def _in_user_namespace() -> bool:
    """Whether this process runs in a user namespace other than the host's."""
    try:
        with open("/proc/self/uid_map", encoding="ascii") as f:
            return f.read().split() != ["0", "0", "4294967295"]
    except OSError:
        return False


def apply_layer(source: str | IO[bytes], target: str, *, expect_diff_id: str | None = None,
                max_bytes: int | None = None) -> dict[str, Any]:
    """Apply the layer tar `source` (path, "-" or binary stream) onto `target`; returns
    the summary (counts, diff_id, warnings). Raises ApplyError or DiffIdMismatch; with
    `max_bytes`, ApplyError once the entries take more (see Applier._spend)."""
    stream, raw = open_layer(source)
    hashing = Hashing(stream)
    reader = io.BufferedReader(hashing, CHUNK)
    applier = Applier(target, max_bytes)
    old_umask = os.umask(0o022)
    try:
        try:
            with tarfile.open(fileobj=reader, mode="r|", encoding="utf-8",
                              errors="surrogateescape") as tar:
                for member in tar:
                    applier.entry(tar, member)
            while reader.read(CHUNK):  # the tar's end padding counts in the diff id
                pass
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise ApplyError(f"invalid layer tar: {exc}") from exc
        applier.finish_dirs()
    finally:
        os.umask(old_umask)
        applier.close()
        if isinstance(source, str) and raw is not sys.stdin.buffer:
            raw.close()  # only what we opened
    diff_id = "sha256:" + hashing.sha.hexdigest()
    summary: dict[str, Any] = {"diff_id": diff_id, "tar_bytes": hashing.size,
                               **applier.counts, "warnings": applier.warnings,
                               "warnings_total": applier.warnings_total}
    check_diff_id(diff_id, expect_diff_id)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Apply an OCI layer tar onto a directory.")
    parser.add_argument("--diff-id", help="expected sha256 of the uncompressed tar")
    parser.add_argument("layer", help="layer .tar / .tar.gz, or - for standard input")
    parser.add_argument("target", help="root directory to apply onto")
    args = parser.parse_args(argv)
    try:
        summary = apply_layer(args.layer, args.target, expect_diff_id=args.diff_id)
    except DiffIdMismatch as exc:
        print(f"apply.py: {exc}", file=sys.stderr)
        return 3
    except (ApplyError, OSError) as exc:
        print(f"apply.py: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
