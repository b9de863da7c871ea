"""An image's first layer streamed straight into `mke2fs -d -` (e2fsprogs 1.47.1+).

Standalone (Python 3.11 stdlib, beside apply.py and confined.py: the confined helper runs
it). mke2fs reads the tar itself (through libarchive) and writes the ext4 in one pass: no
tree on the host's disk, no file created per entry. The tar flows through here on its
way, hashed (the diff id) and read by `tarfile`, header by header (`Plain`).

What mke2fs makes differently from apply.py, and what is done about it:
- xattrs other than `security.capability` (ACLs, `user.*`, ...) are dropped, and mtimes
  lose their nanoseconds: both written afterwards by `debugfs -w` (libext2fs, the same
  conversion of POSIX ACLs into ext4's format as `mke2fs -d` of a tree; an access ACL
  synced with the mode as a chmod would), one command per entry that needs it
  (`fixup_script`). (The tree's way keeps whole seconds only: `mke2fs -d` of a directory
  copies no more.)
- a whiteout would become a file named `.wh.*`, an entry under a symlink or a missing
  directory is refused, a duplicate or a hard link entry whose owner or mode differs from
  its file's is applied otherwise, ...: `NotPlain`, at the first such entry; the caller
  then makes the image through a tree (`populate` of confined.py), by apply.py's rules.
What Debian, Ubuntu and Docker- or BuildKit-built layers carry streams.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import subprocess
import tarfile
import tempfile
import zlib
from typing import IO, Any

try:  # run as a script beside layertar.py (the helper); imported as host.images.streamed
    from layertar import (  # type: ignore[import-not-found,unused-ignore]
        CHUNK,
        WHITEOUT,
        ApplyError,
        Hashing,
        check_diff_id,
        clean_name,
        entry_bytes,
        entry_times,
        entry_xattrs,
        open_layer,
        widen_pipe,
    )
except ImportError:
    from host.images.layertar import (
        CHUNK,
        WHITEOUT,
        ApplyError,
        Hashing,
        check_diff_id,
        clean_name,
        entry_bytes,
        entry_times,
        entry_xattrs,
        open_layer,
        widen_pipe,
    )

# PAX keys that mke2fs's libarchive reads as apply.py does, or that a fixup completes;
# anything else (GNU sparse maps, a charset, ...) goes the tree's way
_PAX_KEYS = frozenset(("path", "linkpath", "size", "uid", "gid", "uname", "gname", "mtime",
                       "atime", "ctime", "hdrcharset"))  # (BINARY: raw bytes, as both read)
_KEPT_XATTR = "security.capability"  # the one xattr mke2fs -d - copies
_FIXUP_BYTES = 16 << 20  # xattr values written afterwards, at most (they pass through /tmp)
_KINDS = (("files", tarfile.TarInfo.isreg), ("dirs", tarfile.TarInfo.isdir),
          ("symlinks", tarfile.TarInfo.issym), ("hardlinks", tarfile.TarInfo.islnk),
          ("fifos", tarfile.TarInfo.isfifo), ("devices", tarfile.TarInfo.isdev))


class NotPlain(Exception):
    """The layer has an entry mke2fs would make differently from apply.py: why."""


class Plain:
    """Checks a first layer's entries, in order, for mke2fs's way (see the module); keeps
    what debugfs writes afterwards in `fixups`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.spent = max_bytes, 0
        self.dirs: set[tuple[str, ...]] = {()}
        self.files: dict[tuple[str, ...], tuple[int, int, int, float]] = {}
        self.seen: set[tuple[str, ...]] = set()
        self.counts = {"entries": 0, "files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0,
                       "devices": 0, "fifos": 0, "bytes": 0, "fixups": 0}
        # (path, mtime ns part or None, {xattr: base64 value}) per entry that needs one
        self.fixups: list[tuple[str, int | None, dict[str, str]]] = []
        self.fixup_bytes = 0

    def entry(self, m: tarfile.TarInfo) -> None:
        self.counts["entries"] += 1
        parts, escaped = clean_name(m.name)
        if escaped or ".." in m.name.split("/"):
            raise NotPlain(f"{m.name!r} climbs")
        xattrs = entry_xattrs(m)
        keys = {k for k in m.pax_headers
                if not k.startswith(("SCHILY.xattr.", "LIBARCHIVE.xattr."))}
        if extra := keys - _PAX_KEYS:
            raise NotPlain(f"{m.name!r} has PAX {min(extra)!r}")
        path = tuple(parts)
        if not parts:  # the root: apply.py keeps the blank's, mke2fs would take these
            if not (m.isdir() and m.mode & 0o7777 == 0o755 and m.uid == 0 and m.gid == 0
                    and not xattrs):
                raise NotPlain(f"the root entry {m.name!r} is not root's plain 0755 directory")
            return
        if any(p.startswith(WHITEOUT) for p in parts):
            raise NotPlain(f"{m.name!r} is a whiteout")
        if path[:-1] not in self.dirs:
            raise NotPlain(f"{m.name!r}: its directory is not an earlier directory entry")
        if path in self.seen and not (m.isdir() and path in self.dirs):
            raise NotPlain(f"{m.name!r} comes twice")
        if m.islnk():
            # mke2fs gives the inode the link entry's owner, mode and mtime (apply.py keeps
            # the file's); tar and Docker write the file's
            meta = self.files.get(tuple(clean_name(m.linkname)[0]))
            if meta is None:
                raise NotPlain(f"{m.name!r} links to {m.linkname!r}, not an earlier file")
            if meta != _meta(m) or xattrs:
                raise NotPlain(f"{m.name!r}: owner, mode or mtime differs from its file's")
        if m.issparse() or not any(test(m) for _, test in _KINDS):
            raise NotPlain(f"{m.name!r} is of tar type {m.type!r}")
        # as apply.py's Applier._spend: past the image's size the tree's way says so
        self.spent += entry_bytes(m)
        if self.spent > self.max_bytes:
            raise NotPlain(f"{m.name!r}: the layer needs more than the image's size")
        if not m.islnk():
            self._fixup(m, parts, xattrs)
        self.seen.add(path)
        if m.isdir():
            self.dirs.add(path)
        elif m.isreg():
            self.files[path] = _meta(m)
            self.counts["bytes"] += m.size
        kind = next(k for k, test in _KINDS if test(m))
        self.counts[kind] += 1

    def _fixup(self, m: tarfile.TarInfo, parts: list[str], xattrs: dict[str, bytes]) -> None:
        """What debugfs writes after mke2fs: the mtime's nanoseconds, the other xattrs."""
        ns = entry_times(m)[1] % 1_000_000_000  # (mke2fs keeps the whole seconds, floored)
        rest = {k: v for k, v in xattrs.items() if k != _KEPT_XATTR}
        if "system.posix_acl_access" in rest:
            rest["system.posix_acl_access"] = _acl_chmod(rest["system.posix_acl_access"],
                                                         m.mode, m.name)
        if not ns and not rest:
            return
        path = "/" + "/".join(parts)
        # debugfs reads its commands with its own quoting: a name it could misread (a
        # quote, a backslash, a control character) is not given to it
        if any(c in path for c in '"\\') or not path.isprintable():
            raise NotPlain(f"{m.name!r} needs a fixup and has a character debugfs misreads")
        self.fixup_bytes += sum(len(k) + len(v) for k, v in rest.items())
        if self.fixup_bytes > _FIXUP_BYTES:
            raise NotPlain(f"{m.name!r}: over {_FIXUP_BYTES >> 20} MiB of xattrs")
        self.fixups.append((path, ns or None, {k: base64.b64encode(v).decode()
                                               for k, v in rest.items()}))
        self.counts["fixups"] += 1


def _acl_chmod(acl: bytes, mode: int, name: str) -> bytes:
    """An access ACL as the kernel leaves it when apply.py chmods after setting it: the
    owner, mask (group without one) and other entries take the mode's bits."""
    if len(acl) < 4 or (len(acl) - 4) % 8 or int.from_bytes(acl[:4], "little") != 2:
        raise NotPlain(f"{name!r} has a malformed POSIX ACL")
    entries = [list(struct.unpack_from("<HHI", acl, off)) for off in range(4, len(acl), 8)]
    tags = {e[0] for e in entries}
    bits = {1: mode >> 6 & 7, 0x20: mode & 7, (0x10 if 0x10 in tags else 4): mode >> 3 & 7}
    for e in entries:
        e[1] = bits.get(e[0], e[1])
    return acl[:4] + b"".join(struct.pack("<HHI", *e) for e in entries)


def _meta(m: tarfile.TarInfo) -> tuple[int, int, int, float]:
    return m.mode & 0o7777, m.uid, m.gid, m.mtime


class _Tee(Hashing):
    """Hashes what is read (the diff id) and writes it on to `sink` (mke2fs's stdin) as
    long as mke2fs reads: once it has stopped (its tar ended, or it failed), the rest is
    only hashed; its exit status tells which."""

    def __init__(self, f: IO[bytes], sink: int) -> None:
        super().__init__(f)
        self.sink = sink

    def readinto(self, buffer: Any) -> int:
        n = super().readinto(buffer)
        view = memoryview(buffer)[:n]
        while self.sink >= 0 and view:
            try:
                view = view[os.write(self.sink, view):]
            except BrokenPipeError:
                self.close_sink()
        return n

    def close_sink(self) -> None:
        if self.sink >= 0:
            os.close(self.sink)
            self.sink = -1


def start_mke2fs(mkfs: list[str], image: str, size_k: int, pass_fds: tuple[int, ...]
                 ) -> tuple[subprocess.Popen[bytes], int, IO[bytes]]:
    """`mke2fs -d -` making the ext4 of `image`: (process, its stdin's write end, the file
    its complaints go to: a pipe it filled while its stdin is written would stop both)."""
    r, w = os.pipe()
    widen_pipe(w)
    err_file = tempfile.TemporaryFile()  # noqa: SIM115 - the caller closes it
    proc = subprocess.Popen(["mke2fs", "-q", "-F", "-t", "ext4", *mkfs, "-d", "-", image,
                             f"{size_k}k"], stdin=r, stdout=subprocess.DEVNULL,
                            stderr=err_file, pass_fds=pass_fds)
    os.close(r)
    return proc, w, err_file


def stream(source: IO[bytes], sink: int, max_bytes: int, *,
           expect_diff_id: str | None = None) -> dict[str, Any]:
    """The tar on `source` (plain or gzip) written to `sink` (closed after), each entry
    checked; the summary (diff_id, counts, fixup_list). NotPlain, DiffIdMismatch, or
    ApplyError for an invalid tar."""
    tee = _Tee(open_layer(source)[0], sink)
    check = Plain(max_bytes)
    try:
        buffered = io.BufferedReader(tee, CHUNK)
        with tarfile.open(fileobj=buffered, mode="r|", encoding="utf-8",
                          errors="surrogateescape") as tar:
            for member in tar:
                check.entry(member)
        while buffered.read(CHUNK):  # the end padding counts in the diff id
            pass
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
        raise ApplyError(f"invalid layer tar: {exc}") from exc
    finally:
        tee.close_sink()
    diff_id = "sha256:" + tee.sha.hexdigest()
    check_diff_id(diff_id, expect_diff_id)
    return {"diff_id": diff_id, "tar_bytes": tee.size,
            **check.counts, "fixup_list": check.fixups, "warnings": [], "warnings_total": 0,
            "streamed": True}


def fixup_script(fixups: list[tuple[str, int | None, dict[str, str]]], scratch: str) -> str:
    """debugfs commands writing `fixups` (xattr values as files under `scratch`)."""
    lines = []
    for i, (path, ns, xattrs) in enumerate(fixups):
        if ns is not None:  # bits 2-31 of the extra field; 0-1 extend the epoch, left 0
            lines.append(f'sif "{path}" mtime_extra {ns << 2}')
        for j, (key, value) in enumerate(xattrs.items()):
            f = os.path.join(scratch, f"{i}.{j}")
            with open(f, "wb") as out:
                out.write(base64.b64decode(value))
            lines.append(f'ea_set -f {f} "{path}" {key}')
    return "\n".join(lines) + "\n"


def run_fixups(image: str, fixups: list[tuple[str, int | None, dict[str, str]]],
               pass_fds: tuple[int, ...]) -> None:
    """`debugfs -w` writing `fixups` into `image`; NotPlain when it complains."""
    with tempfile.TemporaryDirectory() as scratch:
        script = os.path.join(scratch, "fixups")
        with open(script, "w", encoding="utf-8") as f:
            f.write(fixup_script(fixups, scratch))
        proc = subprocess.run(["debugfs", "-w", "-f", script, image], capture_output=True,
                              pass_fds=pass_fds, check=False)
    # it echoes each command on stdout and says only what failed (and its banner) on stderr
    said = [line for line in proc.stderr.decode(errors="replace").splitlines()
            if line.strip() and not line.startswith("debugfs ")]
    if proc.returncode != 0 or said:
        raise NotPlain(f"debugfs: {'; '.join(said)[-300:] or f'exit {proc.returncode}'}")
