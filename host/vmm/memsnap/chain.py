"""Chains of diffs: compose (newer wins), compact past a bound, and content deltas.

A chain is one cumulative diff (pages that differ from the base) followed by deltas, each
holding only the pages whose content differs from the view of the chain before it. A page
that a child no longer has private (only possible after a discard) is carried in a delta with
the base file's content, so no tombstones are needed.
"""

from __future__ import annotations

import itertools
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from .diff import DiffFile, DiffHeader, DiffKind, write_diff
from .errors import MemSnapError, SnapshotMismatchError


class DiffChain:
    """Open, validated diffs, oldest first. Owns the files: use as a context manager."""

    def __init__(self, files: Sequence[DiffFile]) -> None:
        if not files:
            raise MemSnapError("a diff chain needs at least one diff")
        first = files[0].header
        if first.kind != DiffKind.CUMULATIVE:
            raise SnapshotMismatchError(f"{files[0].path}: a chain must start with a cumulative diff")
        for prev, cur in itertools.pairwise(files):
            h = cur.header
            if h.kind != DiffKind.DELTA:
                raise SnapshotMismatchError(f"{cur.path}: only the first diff of a chain may be cumulative")
            if h.parent_digest != prev.digest:
                raise SnapshotMismatchError(f"{cur.path} is not a delta on top of {prev.path}")
            if (h.base_sha256, h.config_sha256, h.page_size, h.mem_pages) != (
                first.base_sha256, first.config_sha256, first.page_size, first.mem_pages,
            ):
                raise SnapshotMismatchError(f"{cur.path}: base, configuration or geometry differ from {files[0].path}")
        self.files = list(files)
        self._view: dict[int, tuple[DiffFile, int]] | None = None

    @classmethod
    def open(cls, paths: Sequence[str | os.PathLike[str]], *, verify: bool = True) -> Self:
        files: list[DiffFile] = []
        try:
            for p in paths:
                files.append(DiffFile.open(p, verify=verify))
            return cls(files)
        except BaseException:
            for f in files:
                f.close()
            raise

    @property
    def head(self) -> DiffHeader:
        """The newest diff's header (its digest identifies the chain)."""
        return self.files[-1].header

    @property
    def first(self) -> DiffHeader:
        return self.files[0].header

    @property
    def page_size(self) -> int:
        return self.first.page_size

    @property
    def mem_pages(self) -> int:
        return self.first.mem_pages

    def __len__(self) -> int:
        return len(self.files)

    def view(self) -> dict[int, tuple[DiffFile, int]]:
        """page index -> (diff holding its newest content, position in that diff)."""
        if self._view is None:
            v: dict[int, tuple[DiffFile, int]] = {}
            for f in self.files:
                for i, p in enumerate(f.indexes):
                    v[p] = (f, i)
            self._view = v
        return self._view

    def page(self, index: int) -> bytes | None:
        """Newest content of ``index`` in the chain, or None if the base has it."""
        hit = self.view().get(index)
        if hit is None:
            return None
        f, i = hit
        off = f.data_offset_of(i)
        return f.mmap[off : off + self.page_size]

    def compose(self) -> tuple[array[int], bytearray]:
        """All pages of the chain's view, sorted, with their newest content."""
        v = self.view()
        idx = array("I", sorted(v))
        ps = self.page_size
        data = bytearray(len(idx) * ps)
        for n, p in enumerate(idx):
            f, i = v[p]
            off = f.data_offset_of(i)
            data[n * ps : (n + 1) * ps] = f.mmap[off : off + ps]
        return idx, data

    def close(self) -> None:
        self._view = None
        for f in self.files:
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_cumulative(chain: DiffChain, path: str | os.PathLike[str], *, fsync: bool = True) -> DiffHeader:
    """Flatten ``chain`` into one cumulative diff at ``path``."""
    idx, data = chain.compose()
    return write_diff(
        path, indexes=idx, data=data, page_size=chain.page_size, mem_pages=chain.mem_pages,
        base_sha256=chain.first.base_sha256, config_sha256=chain.first.config_sha256,
        kind=DiffKind.CUMULATIVE, fsync=fsync,
    )


def compact(chain: DiffChain, path: str | os.PathLike[str], *, max_len: int) -> DiffChain:
    """If the chain is longer than ``max_len``, flatten it into ``path`` and return the new
    one-diff chain (the old one is closed); otherwise return ``chain`` unchanged."""
    if max_len < 1:
        raise ValueError("max_len must be >= 1")
    if len(chain) <= max_len:
        return chain
    write_cumulative(chain, path)
    chain.close()
    return DiffChain.open([path])


def delta_pages(
    parent: DiffChain,
    indexes: Sequence[int],
    data: bytes | bytearray | memoryview,
    *,
    base_path: str | os.PathLike[str] | None = None,
) -> tuple[array[int], bytearray]:
    """The pages of a new cumulative capture whose content differs from ``parent``'s view.

    Pages the parent holds but the capture lacks went back to the base content; they are
    included with the base file's content (read from ``base_path``).
    """
    ps = parent.page_size
    mv = memoryview(data).cast("B")
    if mv.nbytes != len(indexes) * ps:
        raise MemSnapError("capture data size does not match its page count")
    view = parent.view()
    out_idx: list[int] = []
    chunks: dict[int, bytes | memoryview] = {}
    for n, p in enumerate(indexes):
        page = mv[n * ps : (n + 1) * ps]
        hit = view.get(p)
        if hit is not None:
            f, i = hit
            off = f.data_offset_of(i)
            if f.mmap[off : off + ps] == page:
                continue
        out_idx.append(p)
        chunks[p] = page
    captured = set(indexes)
    reverted = [p for p in view if p not in captured]
    if reverted:
        if base_path is None:
            raise MemSnapError(f"{len(reverted)} pages went back to the base: base_path is needed")
        fd = os.open(Path(base_path), os.O_RDONLY)
        try:
            for p in reverted:
                raw = os.pread(fd, ps, p * ps)
                chunks[p] = raw + bytes(ps - len(raw))
                out_idx.append(p)
        finally:
            os.close(fd)
    out_idx.sort()
    out = bytearray(len(out_idx) * ps)
    for n, p in enumerate(out_idx):
        out[n * ps : (n + 1) * ps] = chunks[p]
    return array("I", out_idx), out


def write_delta(
    path: str | os.PathLike[str],
    parent: DiffChain,
    indexes: Sequence[int],
    data: bytes | bytearray | memoryview,
    *,
    base_path: str | os.PathLike[str] | None = None,
    fsync: bool = True,
) -> DiffHeader:
    """Write the content delta of a cumulative capture against ``parent`` at ``path``."""
    idx, out = delta_pages(parent, indexes, data, base_path=base_path)
    return write_diff(
        path, indexes=idx, data=out, page_size=parent.page_size, mem_pages=parent.mem_pages,
        base_sha256=parent.first.base_sha256, config_sha256=parent.first.config_sha256,
        kind=DiffKind.DELTA, parent_digest=parent.head.digest, fsync=fsync,
    )
