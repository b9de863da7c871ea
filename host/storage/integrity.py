"""Checking what comes back from a repository against what was recorded when it went in.

A layer is named by the sha256 of its whole file, but the chunk cache fetches it 1 MiB at
a time, long before (if ever) every byte was read. So an `oss` upload also stores the
layer's `ChunkSums`: the sha256 of each `block` of the file, made in the same pass that
checks the local file against its digest. Each fetched chunk is checked against them
before it enters the cache. Files (memory snapshots) are checked whole: their sha256 is
computed while they are uploaded and recorded by the caller (the snapshot manifest).

A mismatch is fetched once more (`retry_once`: a transfer that went wrong), then it is an
`IntegrityError`; the bad bytes are never kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, TypeVar

from .errors import IntegrityError

log = logging.getLogger(__name__)

T = TypeVar("T")

SUMS_BLOCK = 1 << 20  # = the chunk cache's default chunk: one hash per chunk


@dataclass(frozen=True)
class ChunkSums:
    """The sha256 of each `block` bytes of layer `digest` (the last block may be short)."""

    digest: str
    size: int
    block: int
    sha256: tuple[bytes, ...]

    def to_json(self) -> bytes:
        return json.dumps({"version": 1, "layer": self.digest, "size": self.size,
                           "block": self.block,
                           "sha256": [h.hex() for h in self.sha256]}).encode()

    @classmethod
    def from_json(cls, raw: bytes, digest: str) -> ChunkSums:
        """Parse what `to_json` wrote for `digest`; anything else is an IntegrityError."""
        try:
            doc: dict[str, Any] = json.loads(raw)
            sums = cls(str(doc["layer"]), int(doc["size"]), int(doc["block"]),
                       tuple(bytes.fromhex(h) for h in doc["sha256"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"layer {digest}: malformed chunk sums: {exc}") from exc
        blocks = -(-sums.size // sums.block) if sums.block > 0 else -1
        if sums.digest != digest or len(sums.sha256) != blocks:
            raise IntegrityError(f"layer {digest}: its chunk sums describe another layer")
        return sums

    def check(self, offset: int, data: bytes) -> None:
        """Raise IntegrityError unless `data`, read at `offset` (a multiple of `block`),
        matches every block it covers (it must end on a block boundary or at the end)."""
        if offset % self.block or (len(data) % self.block and offset + len(data) != self.size):
            raise IntegrityError(f"layer {self.digest}: range {offset}+{len(data)} is not "
                                 f"aligned to its {self.block}-byte checksum blocks")
        view = memoryview(data)
        for pos in range(0, len(data), self.block):
            idx = (offset + pos) // self.block
            got = hashlib.sha256(view[pos:pos + self.block]).digest()
            if idx >= len(self.sha256) or got != self.sha256[idx]:
                raise IntegrityError(f"layer {self.digest}: bytes {offset + pos}.."
                                     f"{offset + min(pos + self.block, len(data))} do not "
                                     f"match their recorded sha256")


def sums_of_file(path: str | os.PathLike[str], digest: str, *,
                 block: int = SUMS_BLOCK) -> ChunkSums:
    """The chunk sums of a local layer file, checked against its digest in the same pass
    (a layer that does not match its name is never uploaded). Blocking."""
    whole = hashlib.sha256()
    sums: list[bytes] = []
    size = 0
    with open(path, "rb") as f:
        while buf := f.read(block):
            whole.update(buf)
            sums.append(hashlib.sha256(buf).digest())
            size += len(buf)
    if f"sha256:{whole.hexdigest()}" != digest:
        raise IntegrityError(f"layer file {path} does not match its digest {digest} "
                             f"(sha256:{whole.hexdigest()})")
    return ChunkSums(digest, size, block, tuple(sums))


class HashingReader:
    """A read()-only view of a binary file that hashes every byte read through it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.hash.update(data)
        return data

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def retry_once(what: str, attempt: Callable[[], T]) -> T:
    """Run `attempt` (a fetch that raises IntegrityError when what it got does not match
    its digest); if it did, log it and fetch once more: a second mismatch is raised."""
    try:
        return attempt()
    except IntegrityError as exc:
        log.warning("%s: %s: fetching it again", what, exc)
    return attempt()
