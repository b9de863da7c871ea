"""One memory image for the children of a fork (issue 30: children cost what they touch).

A restore writes its snapshot's diff chain into the new VM's RAM (`restore_into`): every
child of a fork gets a private copy of every page the parent had changed since its base. A
parent that loaded a dataset or a model into memory during its setup makes sixteen
children hold sixteen copies of it. When several starts of one snapshot come at once (a
fork's `fanout`) and its diff is worth sharing, the base and the chain are made once into a
new frozen base beside the snapshot's files (`memory/<snapshot id>/flat/`, memsnap's
`flatten_base`) and every child maps that copy-on-write, as a template's sandboxes map its
base: a page the parent changed is one page of the host's page cache however many children
read it, and a child's own later diffs start from nothing.

The image is made once per snapshot (a lock per snapshot; kept while the snapshot's memory
is, and collected with it: it lives in the snapshot's memory dir), and put in the
repository at once: the snapshots of a child name it as their base, and a restore on
another node fetches it like any base. A snapshot whose diff is small, or a lone start (a
resume), restores as before: the copy costs more than the injection then. Nor does a fork
fail because its image could not be made (a full disk): its children restore the chain,
each its own copy, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections import OrderedDict
from pathlib import Path

from host.keyedlocks import KeyedLocks
from host.storage.errors import StorageError
from host.vmm.memsnap import BaseImage, MemSnapError, MemSnapshot, flatten_base
from host.vmm.memsnap.base import BASE_MANIFEST  # a base's manifest: its commit point

from .errors import NodeRuntimeError
from .memory import MemoryFiles

log = logging.getLogger(__name__)

FLAT_DIR = "flat"  # memory/<snapshot id>/flat/: the snapshot's base + chain as one base
# snapshots whose starts are counted (the most recent): a checkpoint branched from one
# child at a time shares an image from its second start on
REMEMBERED = 1024


class ForkImageError(NodeRuntimeError):
    """The shared image could not be made or read (the start restores the chain instead)."""


class ForkImages:
    def __init__(self, memory: MemoryFiles, *, min_mib: int) -> None:
        self.memory = memory
        self.min_mib = min_mib  # per child; 0: never share (every child injects its chain)
        self._locks = KeyedLocks()  # snapshot id -> its image being made
        self._starts: OrderedDict[str, int] = OrderedDict()  # snapshot id -> starts seen
        self.made = 0  # images this node flattened (tests and bench_fork read it)

    def use(self, snapshot_id: str, snap: MemSnapshot, fanout: int) -> bool:
        """Whether a start of `snapshot_id` (one of `fanout` coming at once) maps a shared
        image: one is made already (a lone start too: it costs nothing more then, and the
        sandbox's diffs start from it), or the snapshot has more than one start (several
        children at once, or a paused checkpoint branched from one child at a time: its
        second start on), each of which would copy at least `min_mib` of diff. A lone
        start (a resume) injects its chain: cheaper than a copy of the whole memory."""
        if (self.memory.dir / snapshot_id / FLAT_DIR / BASE_MANIFEST).exists():
            return True
        seen = self._starts.pop(snapshot_id, 0) + 1
        self._starts[snapshot_id] = seen
        while len(self._starts) > REMEMBERED:
            self._starts.popitem(last=False)
        if max(fanout, seen) < 2 or self.min_mib <= 0:
            return False
        size = sum(os.path.getsize(d) for d in snap.diffs if os.path.exists(d))
        return size >= self.min_mib << 20

    async def image(self, snapshot_id: str, base: BaseImage, snap: MemSnapshot
                    ) -> tuple[BaseImage, dict[str, str], dict[str, float]]:
        """The snapshot's shared image (made now if this node has none): the new base, the
        sha256 of its files as the repository has them (what the snapshots of its
        children record for a fetch to check), and what making it took."""
        d = self.memory.dir / snapshot_id / FLAT_DIR
        timings: dict[str, float] = {}
        try:
            async with self._locks.hold(snapshot_id):
                flat = await asyncio.to_thread(_load, d)
                if flat is None:
                    t0 = time.perf_counter()
                    try:
                        flat = await asyncio.to_thread(flatten_base, snap, base, d)
                        timings["flatten_s"] = time.perf_counter() - t0
                        t1 = time.perf_counter()
                        await self.memory.upload(d)
                        timings["upload_flat_s"] = time.perf_counter() - t1
                    except BaseException:
                        # none of it is used (no VM maps an image before its upload):
                        # a full memory copy must not stay behind a failure
                        await asyncio.to_thread(shutil.rmtree, d, True)
                        raise
                    self.made += 1
                    log.info("snapshot %s: its children share one memory image (%s): made "
                             "in %.0f ms, put in the repository in %.0f ms", snapshot_id,
                             d, timings["flatten_s"] * 1e3, timings["upload_flat_s"] * 1e3)
                sha = await asyncio.to_thread(self._hashes, flat)
        except (MemSnapError, OSError, StorageError) as exc:
            raise ForkImageError(f"snapshot {snapshot_id}: its shared memory image: {exc}") from exc
        return flat, sha, timings

    def _hashes(self, flat: BaseImage) -> dict[str, str]:
        out = {self.memory.rel(flat.mem_path): flat.id}
        for f in (flat.template_path, flat.dir / BASE_MANIFEST):
            out[self.memory.rel(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
        return out


def _load(d: Path) -> BaseImage | None:
    """The image a start made before (base.json is its commit point), or None."""
    if not (d / BASE_MANIFEST).exists():
        return None
    try:
        return BaseImage.load(d)
    except MemSnapError:  # torn by a crash before its commit: made again
        return None
