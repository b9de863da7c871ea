"""What every repository backend shares: the `Repository` protocol, the checks on the
names it is given (digests, manifest names, file keys) and the byte counter it keeps."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Protocol

from ..errors import IntegrityError
from ..integrity import ChunkSums


def digest_hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


def check_name(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad manifest name {name!r}")
    return name


def check_key(key: str) -> str:
    """A file key: relative, `/`-separated, no empty, `.` or `..` parts, no dot-files."""
    parts = key.split("/")
    if not key or any(not p or p.startswith(".") for p in parts):
        raise ValueError(f"bad file key {key!r}")
    return key


def check_sha256(what: str, got: str, want: str) -> None:
    if got != want:
        raise IntegrityError(f"file {what}: content sha256 {got} does not match the "
                             f"recorded {want}")


class Transferred:
    """Bytes a repository object moved to (upload) and from (download) its backend since
    it was opened. Thread-safe: repository calls run in worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.upload_bytes = 0
        self.download_bytes = 0

    def uploaded(self, n: int) -> None:
        if n > 0:  # boto3 progress callbacks report a retried part's bytes negative
            with self._lock:
                self.upload_bytes += n

    def downloaded(self, n: int) -> None:
        if n > 0:
            with self._lock:
                self.download_bytes += n


class Repository(Protocol):
    """Where layers and manifests are kept durably."""

    def has_layer(self, digest: str) -> bool: ...
    def layer_size(self, digest: str) -> int: ...
    def read_layer(self, digest: str, offset: int, length: int) -> bytes: ...
    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> None: ...
    def local_path(self, digest: str) -> Path | None: ...
    def layer_sums(self, digest: str) -> ChunkSums | None:
        """What chunks read with `read_layer` are checked against (None: not recorded)."""
        ...
    def put_manifest(self, name: str, manifest: dict[str, Any]) -> None: ...
    def get_manifest(self, name: str) -> dict[str, Any]: ...
    def list_manifests(self) -> list[str]: ...
    def delete_manifest(self, name: str) -> None: ...
    def put_file(self, key: str, path: str | os.PathLike[str]) -> str | None:
        """Store an immutable file; returns the sha256 (hex) of its content when the
        backend computed it while copying (None: the bytes are shared, not copied)."""
        ...
    def fetch_file(self, key: str, dest: str | os.PathLike[str], *,
                   sha256: str | None = None) -> None:
        """Copy a file to `dest` (atomically); with `sha256`, its content must match
        (refetched once, then IntegrityError, and `dest` is not created)."""
        ...
    def has_file(self, key: str) -> bool: ...
    def delete_files(self, prefix: str) -> int:
        """Remove the files under `prefix` (a directory of keys); the bytes that frees."""
        ...
    def delete_layer(self, digest: str) -> int:
        """Remove a layer (and what describes it); the bytes it held (0: it was absent)."""
        ...
