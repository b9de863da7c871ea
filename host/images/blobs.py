"""Content-addressed blobs of the OCI cache, read only through digest checks.

`read_blob()` returns a small blob (manifest, index, config) after checking its size and
sha256; `verify_blob()` hashes a large one (a layer) in a streaming pass; `VerifyingReader`
checks a blob while it is streamed (`layout.open_layer`).
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import IO

from .errors import ImageCorrupt

CHUNK = 1 << 20
SMALL_BLOB_MAX = 8 << 20  # manifests, indexes and configs are KiBs; refuse anything huge


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(blobs_dir: Path, digest: str) -> Path:
    """Where blob `digest` lives (`<blobs_dir>/sha256/<hex>`)."""
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef"
                                                          for c in hexpart):
        raise ImageCorrupt(f"unsupported or malformed digest {digest!r}")
    return blobs_dir / "sha256" / hexpart


def read_blob(blobs_dir: Path, digest: str, *, size: int | None = None,
              what: str = "blob") -> bytes:
    """The bytes of a small blob, checked against `digest` (and `size` when given)."""
    path = blob_path(blobs_dir, digest)
    try:
        with open(path, "rb") as f:
            data = f.read(SMALL_BLOB_MAX + 1)
    except FileNotFoundError:
        raise ImageCorrupt(f"{what} {digest} is missing from the cache ({path})") from None
    if len(data) > SMALL_BLOB_MAX:
        raise ImageCorrupt(f"{what} {digest} is larger than {SMALL_BLOB_MAX} bytes")
    if size is not None and len(data) != size:
        raise ImageCorrupt(f"{what} {digest} has {len(data)} bytes, its descriptor says {size}",
                           path=path)
    actual = sha256_digest(data)
    if actual != digest:
        raise ImageCorrupt(f"{what} {digest} does not match its content ({actual})", path=path)
    return data


def write_blob(blobs_dir: Path, data: bytes) -> str:
    """Store `data` under its digest (atomically; a no-op when present); returns the digest."""
    digest = sha256_digest(data)
    path = blob_path(blobs_dir, digest)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return digest


def verify_blob(path: Path, digest: str, size: int | None = None) -> None:
    """Hash the file at `path` in one streaming pass; ImageCorrupt unless it matches."""
    h = hashlib.sha256()
    n = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                n += len(chunk)
    except FileNotFoundError:
        raise ImageCorrupt(f"blob {digest} is missing from the cache ({path})") from None
    if size is not None and n != size:
        raise ImageCorrupt(f"blob {digest} has {n} bytes, its descriptor says {size}", path=path)
    if "sha256:" + h.hexdigest() != digest:
        raise ImageCorrupt(f"blob {digest} does not match its content "
                           f"(sha256:{h.hexdigest()}): {path}", path=path)


class VerifyingReader(io.RawIOBase):
    """Reads a file and raises ImageCorrupt at EOF unless its sha256 and size match."""

    def __init__(self, f: IO[bytes], digest: str, size: int | None) -> None:
        self._f = f
        self._digest = digest
        self._size = size
        self._hash = hashlib.sha256()
        self._n = 0
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        data = self._f.read(len(buffer))
        if data:
            self._hash.update(data)
            self._n += len(data)
            buffer[:len(data)] = data
            return len(data)
        if not self._checked:
            self._checked = True
            actual = "sha256:" + self._hash.hexdigest()
            if (self._size is not None and self._n != self._size) or actual != self._digest:
                raise ImageCorrupt(f"layer {self._digest} does not match its content "
                                   f"({self._n} bytes, {actual})")
        return 0

    def close(self) -> None:
        self._f.close()
        super().close()
