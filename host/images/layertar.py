"""An OCI image layer tar as both of its writers read it: apply.py (onto a tree) and
streamed.py (through `mke2fs -d -`). One place for what an entry means: its name below
the root, the space it takes, its times and xattrs from PAX headers, the layer's
compression and its diff id.

Standalone (Python 3.11 stdlib): the confined helper copies it beside apply.py,
streamed.py and confined.py (host/runtime/importhelper.py).
"""

from __future__ import annotations

import base64
import decimal
import fcntl
import gzip
import hashlib
import io
import sys
import tarfile
from typing import IO, Any
from urllib.parse import unquote

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
AUFS_META = ".wh..wh."
CHUNK = 1 << 20


_F_SETPIPE_SZ = 1031


def widen_pipe(fd: int) -> None:
    """The pipe of `fd` made CHUNK bytes wide where this host allows (pipe-max-size): a
    layer flowing between processes through the default 64 KiB wakes both ~16 times per
    MiB (igzip into the helper: 1.28 s -> 0.82 s for the bench's 283 MiB layer)."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, CHUNK)
    except OSError:
        pass  # over this host's pipe-max-size: the default works


class ApplyError(Exception):
    """The layer cannot be applied (invalid entry, missing link target, I/O error)."""


class DiffIdMismatch(ApplyError):
    """The uncompressed tar does not hash to the expected diff id."""


class Hashing(io.RawIOBase):
    """Passes reads through, hashing every byte."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._f.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha.update(data)
        self.size += n
        return n


def clean_name(name: str) -> tuple[list[str], bool]:
    """Components of an archive name relative to the root, and whether it tried to
    leave the root (an absolute name or a `..` above the top) and was neutralised."""
    parts: list[str] = []
    escaped = name.startswith("/")
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            else:
                escaped = True
            continue
        parts.append(part)
    return parts, escaped


def entry_bytes(m: tarfile.TarInfo) -> int:
    """What an entry takes on a filesystem, at least: its data in whole 4 KiB blocks, or
    one block (an inode's worth) for an entry without data."""
    return -(-max(m.size if m.isreg() else 0, 1) // 4096) * 4096


def check_diff_id(diff_id: str, expected: str | None) -> None:
    """DiffIdMismatch unless the layer hashed to `expected` (when one is given)."""
    if expected is not None and diff_id != expected:
        raise DiffIdMismatch(f"layer diff id is {diff_id}, expected {expected}")


def entry_times(m: tarfile.TarInfo) -> tuple[int, int]:
    """(atime, mtime) in ns, exact from PAX decimal strings (a float loses the ns)."""
    mtime = _ns(m.pax_headers.get("mtime"), m.mtime)
    atime = m.pax_headers.get("atime")
    return (_ns(atime, m.mtime) if atime else mtime), mtime


def _ns(text: str | None, fallback: float) -> int:
    if text:
        try:
            return int(decimal.Decimal(text).scaleb(9))
        except (decimal.InvalidOperation, ValueError):
            pass
    return int(decimal.Decimal(repr(float(fallback))).scaleb(9))


def entry_xattrs(m: tarfile.TarInfo) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            # tarfile decoded the value as UTF-8 with surrogateescape: undo it exactly
            out[key[len("SCHILY.xattr."):]] = value.encode("utf-8", "surrogateescape")
        elif key.startswith("LIBARCHIVE.xattr."):
            try:
                out[unquote(key[len("LIBARCHIVE.xattr."):])] = base64.b64decode(
                    value + "=" * (-len(value) % 4))
            except ValueError:
                continue
    return out


def open_layer(source: str | IO[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """(decompressed stream, raw stream to close) of a plain or gzip tar; ApplyError for
    zstd or unknown formats."""
    if isinstance(source, str):
        raw: IO[bytes] = sys.stdin.buffer if source == "-" else open(source, "rb")  # noqa: SIM115
    else:
        raw = source
    head = b""
    while len(head) < 4:  # a pipe may deliver fewer bytes per read
        more = raw.read(4 - len(head))
        if not more:
            break
        head += more
    stream = io.BufferedReader(_Prefixed(head, raw), CHUNK)
    if head.startswith(GZIP_MAGIC):
        return gzip.GzipFile(fileobj=stream, mode="rb"), raw  # type: ignore[return-value]
    if head == ZSTD_MAGIC:
        raise ApplyError("zstd-compressed layer: the host must decompress it first")
    return stream, raw


class _Prefixed(io.RawIOBase):
    """`head` (already read from `f`), then the rest of `f`."""

    def __init__(self, head: bytes, f: IO[bytes]) -> None:
        self._head = head
        self._f = f

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._f.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)
