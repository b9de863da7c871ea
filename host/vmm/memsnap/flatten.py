"""A base and a snapshot's diff chain made into one new frozen base (`flatten_base`).

Diffs of a VM are cumulative against its base and only grow; a new base resets them, and it
is the one memory image the children of a fork share: each maps it copy-on-write
(``share=off``), so a page the fork's parent had changed costs the host one page in the page
cache however many children read it, instead of one private copy per child written in by
``restore_into``.

One pass over the base's length: its data extents (SEEK_DATA / SEEK_HOLE: a hole is read
neither from disk nor into memory) merged with the chain's pages, hashed as they are
written; an all-zero chunk stays a hole. The sha256 of the whole content is the new base's
identity, as a frozen base's is; it is most of the pass's CPU (holes hash as zeros), so it
runs in a thread of its own behind the copy (hashlib lets go of the GIL while it hashes).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from host.durable import write_atomic

from .base import PRIVATE_MODE, BaseImage, commit_base, data_extents, verify_base
from .chain import DiffChain
from .errors import CorruptSnapshotError, MemSnapError, SnapshotMismatchError
from .snapshot import MemSnapshot

_CHUNK = 1 << 20
_ZEROS_VIEW = memoryview(bytes(_CHUNK))
_HASH_BEHIND = 16  # chunks the hash may lag behind the copy (their buffers stay alive)


def flatten_base(snapshot: MemSnapshot, base: BaseImage, dest_dir: str | os.PathLike[str]) -> BaseImage:
    """Materialise ``base`` + ``snapshot``'s chain into a new frozen base in ``dest_dir``.

    The snapshot's device state becomes the new template, so ``restore_base_into`` on the
    new base resumes the snapshot and later diffs are taken against it. Blocking: run it in
    a thread. ``base.json`` is written last (the commit point), after the memory file is
    fsynced and renamed into place read-only."""
    if snapshot.base_sha256 != base.sha256:
        raise SnapshotMismatchError(f"snapshot {snapshot.dir} does not belong to base {base.id[:16]}")
    verify_base(base)
    d = Path(dest_dir)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    # a name of its own: a flatten abandoned by its caller (cancelled, its thread still
    # running) must not rename another one's half-written file into place
    tmp = d / f".base.mem.{uuid.uuid4().hex[:12]}.tmp"
    t0 = time.perf_counter()
    try:
        with snapshot.open_chain(verify=True) as chain:
            if chain.mem_pages * chain.page_size != base.size:
                raise SnapshotMismatchError(f"snapshot {snapshot.dir} is for another RAM size")
            dev = snapshot.devstate.read_bytes()
            if hashlib.sha256(dev).digest() != snapshot.devstate_sha256:
                raise CorruptSnapshotError(f"{snapshot.devstate}: device state checksum mismatch")
            digest = _merge(base, chain, tmp)
        write_atomic(d / "base.dev", dev)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return commit_base(d, tmp, d / "base.dev", digest, base.size, parent_base=base.id,
                       from_snapshot=os.fspath(snapshot.dir),
                       flatten_ms=round((time.perf_counter() - t0) * 1e3, 3))


class _Hasher:
    """sha256 of chunks fed in order, computed by one worker thread (FIFO: in order)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.h = hashlib.sha256()
        self.pool = pool
        self.pending: deque[Future[None]] = deque()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.pending.append(self.pool.submit(self.h.update, data))
        if len(self.pending) > _HASH_BEHIND:
            self.pending.popleft().result()

    def digest(self) -> bytes:
        while self.pending:
            self.pending.popleft().result()
        return self.h.digest()


def _merge(base: BaseImage, chain: DiffChain, dst: Path) -> bytes:
    """Write base + chain into ``dst`` (sparse, fsynced); return the sha256 of the content."""
    with ThreadPoolExecutor(1, thread_name_prefix="flatten-sha256") as pool:
        h = _Hasher(pool)
        _copy(base, chain, dst, h)
        return h.digest()


def _copy(base: BaseImage, chain: DiffChain, dst: Path, h: _Hasher) -> None:
    ps = chain.page_size
    pages = sorted(chain.view())
    sfd = os.open(base.mem_path, os.O_RDONLY)
    try:
        extents = data_extents(sfd, base.size)
        starts = [s for s, _ in extents]
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
        try:
            os.fchmod(dfd, PRIVATE_MODE)
            os.ftruncate(dfd, base.size)
            for off in range(0, base.size, _CHUNK):
                end = min(off + _CHUNK, base.size)
                lo = bisect.bisect_left(pages, off // ps)
                hi = bisect.bisect_left(pages, (end + ps - 1) // ps)
                # the extent that may overlap [off, end): the last one starting before end
                e = bisect.bisect_left(starts, end) - 1
                in_data = e >= 0 and extents[e][1] > off
                if not in_data and lo == hi:
                    h.update(_ZEROS_VIEW[: end - off])  # a hole the chain does not touch
                    continue
                buf = bytearray(os.pread(sfd, end - off, off)) if in_data else bytearray(end - off)
                if len(buf) != end - off:
                    raise MemSnapError(f"{base.mem_path} shrank while flattening")
                for p in pages[lo:hi]:
                    page = chain.page(p)
                    assert page is not None
                    at = p * ps - off
                    buf[at : at + ps] = page
                h.update(buf)
                if buf.count(0) != len(buf):  # an all-zero chunk stays a hole
                    os.pwrite(dfd, buf, off)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
