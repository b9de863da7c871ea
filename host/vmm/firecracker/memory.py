"""Firecracker snapshot files <-> memsnap's on-disk form (blocking: run in a thread).

The runtime keeps memory snapshots in memsnap's form whatever the VMM: a frozen base
(`base.mem` + template + `base.json`) and diff chains on it (`snapshot.json`). For
Firecracker:

- freeze: a Full snapshot's memory file becomes `base.mem` (sparse copy, sha256); its
  vmstate is the base's template (what a VM restored from the bare base loads).
- snapshot: a Diff snapshot's memory file is sparse and holds exactly the pages dirtied
  since the last snapshot or load (KVM dirty log, `track_dirty_pages`); the data extents
  (SEEK_DATA/SEEK_HOLE) are those pages. They are a delta on the chain the VM's memory
  was at when its dirty log was last reset (`Lineage`), re-expressed on the `parent`
  the caller names, or written cumulative when the chain would pass `max_chain`.
- restore: base + chain are materialised into one private memory file that Firecracker
  maps (its File backend maps copy-on-write and never writes it); a bare base is loaded
  as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from host.durable import write_atomic

from ..memsnap import (
    PAGE_SIZE,
    BaseImage,
    DiffFile,
    DiffHeader,
    DiffKind,
    MemSnapError,
    MemSnapshot,
    verify_base,
    write_delta,
    write_diff,
)
from ..memsnap.base import PRIVATE_MODE, data_extents, install_base
from ..memsnap.snapshot import SNAPSHOT_MANIFEST

BASE_TEMPLATE = "base.vmstate"
DEVSTATE = "devstate.vmstate"
FULL_MEM = ".fc-full.mem"
DIFF_MEM = ".fc-diff.mem"
Pages = dict[int, bytes | memoryview]


@dataclass(frozen=True)
class Lineage:
    """What a VM's memory equalled when its dirty log was last reset (load, or the last
    snapshot): `base` plus `head`'s chain (None: the base itself)."""

    base: BaseImage
    head: MemSnapshot | None

    def check(self, base: BaseImage, parent: MemSnapshot | None) -> None:
        """Whether a diff taken now can be written on `parent` (same base, readable
        chain): checked before the snapshot, which would reset the dirty log."""
        if base.sha256 != self.base.sha256:
            raise MemSnapError(f"this VM runs on base {self.base.id[:16]}, not {base.id[:16]}")
        if parent is not None:
            if parent.base_sha256 != base.sha256:
                raise MemSnapError(f"parent snapshot {parent.dir} belongs to another base")
            parent.open_chain(verify=False).close()

    def continues(self, parent: MemSnapshot | None) -> bool:
        """Whether the head's chain extends the parent's (then the dirty pages plus the
        head's extra diffs are a delta on the parent)."""
        mine = self.head.digests if self.head is not None else ()
        theirs = parent.digests if parent is not None else ()
        return mine[:len(theirs)] == theirs


def read_dirty_pages(path: Path, size: int) -> tuple[array[int], bytearray]:
    """The pages of a Firecracker Diff memory file (page indexes, data in index order)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            raise MemSnapError(f"{path}: {st.st_size} bytes, the guest has {size}")
        extents = data_extents(fd, size)
        pages = array("I")
        for start, end in extents:
            pages.extend(range(start // PAGE_SIZE, -(-end // PAGE_SIZE)))
        if len(pages) * PAGE_SIZE > st.st_blocks * 512 + PAGE_SIZE * len(extents):
            # A filesystem without SEEK_DATA reports the whole file as data: its holes
            # would then pass for pages of zeros, which is wrong content, not a superset.
            raise MemSnapError(f"{path}: the filesystem does not report holes "
                               f"({len(pages)} pages of data but {st.st_blocks} blocks)")
        data = bytearray(len(pages) * PAGE_SIZE)
        view = memoryview(data)
        n = 0
        for start, end in extents:
            first, last = start // PAGE_SIZE, -(-end // PAGE_SIZE)
            want = (last - first) * PAGE_SIZE
            got = os.preadv(fd, [view[n:n + want]], first * PAGE_SIZE)
            if got < want and first * PAGE_SIZE + got < size:
                raise MemSnapError(f"{path}: short read at page {first}")
            n += want
        return pages, data
    finally:
        os.close(fd)


def _overlay(layers: list[Pages]) -> tuple[array[int], bytearray]:
    merged: Pages = {}
    for layer in layers:
        merged.update(layer)
    idx = array("I", sorted(merged))
    data = bytearray(len(idx) * PAGE_SIZE)
    for n, p in enumerate(idx):
        data[n * PAGE_SIZE:(n + 1) * PAGE_SIZE] = merged[p]
    return idx, data


def _diff_pages(paths: tuple[Path, ...], files: list[DiffFile]) -> list[Pages]:
    layers = []
    for p in paths:
        f = DiffFile.open(p, verify=True)
        files.append(f)
        layer: Pages = {i: f.page(i) or b"" for i in f.indexes}
        layers.append(layer)
    return layers


def write_snapshot(dest: Path, *, diff_mem: Path, vmstate: Path, lineage: Lineage,
                   base: BaseImage, parent: MemSnapshot | None, config_sha256: bytes,
                   max_chain: int, stats: dict[str, float], t_call: float) -> MemSnapshot:
    """Turn a Diff snapshot (`diff_mem` + `vmstate`) into a committed MemSnapshot in
    `dest`: mem.diff, devstate.vmstate, snapshot.json (written last)."""
    t0 = time.perf_counter()
    lineage.check(base, parent)
    idx, data = read_dirty_pages(diff_mem, base.size)
    new: Pages = {p: memoryview(data)[n * PAGE_SIZE:(n + 1) * PAGE_SIZE]
                  for n, p in enumerate(idx)}
    diff_path = dest / "mem.diff"
    hdr, chain, digests = _write_diff(diff_path, new, lineage=lineage, base=base,
                                      parent=parent, config_sha256=config_sha256,
                                      max_chain=max_chain)
    devstate = dest / DEVSTATE
    if vmstate.resolve() != devstate.resolve():
        shutil.move(vmstate, devstate)
    dev_sha = hashlib.sha256(devstate.read_bytes()).digest()
    diff_mem.unlink(missing_ok=True)
    stats.update({"diff_pages": float(hdr.count), "dirty_pages": float(len(idx)),
                  "chain_len": float(len(chain) + 1),
                  "convert_ms": (time.perf_counter() - t0) * 1e3,
                  "total_ms": (time.perf_counter() - t_call) * 1e3})
    snap = MemSnapshot(dest, base.sha256, config_sha256, (*chain, diff_path.resolve()),
                       (*digests, hdr.digest), devstate, dev_sha, stats)
    write_atomic(dest / SNAPSHOT_MANIFEST, snap._manifest())  # the commit point
    return snap


def _write_diff(path: Path, new: Pages, *, lineage: Lineage, base: BaseImage,
                parent: MemSnapshot | None, config_sha256: bytes, max_chain: int
                ) -> tuple[DiffHeader, tuple[Path, ...], tuple[bytes, ...]]:
    """Write the diff that takes `parent`'s view (None: the base) to the VM's memory
    (the lineage's view with `new` over it): a delta on the parent's chain, or
    cumulative without a parent or past `max_chain`. Returns (header, parent chain
    paths, their digests) for the snapshot's manifest."""
    head = lineage.head
    common = {"page_size": PAGE_SIZE, "mem_pages": base.size // PAGE_SIZE,
              "base_sha256": base.sha256, "config_sha256": config_sha256}
    files: list[DiffFile] = []
    try:
        if parent is None or len(parent.diffs) + 1 > max_chain:
            # Cumulative: the VM's whole view against the base.
            older = parent.diffs if parent is not None and lineage.continues(parent) else ()
            head_diffs = head.diffs[len(older):] if head is not None else ()
            idx, data = _overlay([*_diff_pages(older, files), *_diff_pages(head_diffs, files),
                                  new])
            hdr = write_diff(path, indexes=idx, data=data, kind=DiffKind.CUMULATIVE,
                             **common)  # type: ignore[arg-type]
            return hdr, (), ()
        if lineage.continues(parent):
            # The pages the lineage holds beyond the parent's chain, then the dirty ones.
            extra = head.diffs[len(parent.diffs):] if head is not None else ()
            idx, data = _overlay([*_diff_pages(extra, files), new])
            hdr = write_diff(path, indexes=idx, data=data, kind=DiffKind.DELTA,
                             parent_digest=parent.digests[-1], **common)  # type: ignore[arg-type]
        else:
            # Another branch of the same base: a content delta of the whole view.
            head_diffs = head.diffs if head is not None else ()
            idx, data = _overlay([*_diff_pages(head_diffs, files), new])
            with parent.open_chain(verify=True) as pchain:
                hdr = write_delta(path, pchain, idx, data, base_path=base.mem_path)
        return hdr, parent.diffs, parent.digests
    finally:
        for f in files:
            f.close()


def freeze_files(dest: Path, *, full_mem: Path, vmstate: Path, t0: float) -> BaseImage:
    """Turn a Full snapshot into a frozen base in `dest`: base.mem (sparse, 0444),
    base.vmstate (the template), base.json (written last)."""
    template = dest / BASE_TEMPLATE
    if vmstate.resolve() != template.resolve():
        shutil.move(vmstate, template)
    try:
        return install_base(dest, full_mem, template, t0=t0, vmm="firecracker")
    finally:
        full_mem.unlink(missing_ok=True)


def verify_restore(base: BaseImage, snapshot: MemSnapshot | None,
                   config_sha256: bytes) -> None:
    """Check every file a restore reads, before any process is started."""
    verify_base(base)
    if not base.template_path.is_file():
        raise MemSnapError(f"base template {base.template_path} is missing")
    if snapshot is None:
        return
    if snapshot.base_sha256 != base.sha256:
        raise MemSnapError(f"snapshot {snapshot.dir} is for base "
                           f"{snapshot.base_sha256.hex()[:16]}, not {base.id[:16]}")
    if snapshot.config_sha256 != config_sha256:
        raise MemSnapError(f"snapshot {snapshot.dir} was taken with another Firecracker "
                           "configuration (version, machine, kernel or devices)")
    with snapshot.open_chain(verify=True) as chain:
        if chain.mem_pages * chain.page_size != base.size:
            raise MemSnapError(f"snapshot {snapshot.dir} is for another RAM size")
    try:
        dev = snapshot.devstate.read_bytes()
    except OSError as exc:
        raise MemSnapError(f"cannot read device state {snapshot.devstate}: {exc}") from exc
    if hashlib.sha256(dev).digest() != snapshot.devstate_sha256:
        raise MemSnapError(f"{snapshot.devstate}: device state checksum mismatch")


def materialise(base: BaseImage, snapshot: MemSnapshot, dest: Path) -> int:
    """base.mem with the chain's pages written over it, as the sparse file `dest` (the
    VM's private memory file). Returns the number of pages written."""
    sfd = os.open(base.mem_path, os.O_RDONLY)
    try:
        dfd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
        try:
            os.fchmod(dfd, PRIVATE_MODE)  # guest RAM: root's only, whatever the umask
            os.ftruncate(dfd, base.size)
            for start, end in data_extents(sfd, base.size):
                off = start
                while off < end:  # in-kernel copy; holes stay holes
                    n = os.copy_file_range(sfd, dfd, end - off, off, off)
                    if n <= 0:
                        raise MemSnapError(f"{base.mem_path} shrank while copying")
                    off += n
            with snapshot.open_chain(verify=False) as chain:
                view = chain.view()
                for p in sorted(view):
                    page = chain.page(p)
                    assert page is not None
                    os.pwrite(dfd, page, p * PAGE_SIZE)
                return len(view)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
