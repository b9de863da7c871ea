"""`MemoryFiles`: the node's `memory/` dir as a cache of the repository's memory files.

Layout: `memory/<snapshot id>/base/` (frozen bases) and `memory/<snapshot id>/mem/`
(diffs + device state). Manifests name files relative to `memory/`; in the repository
they live as `memory/<relpath>`. A snapshot's files are uploaded before its manifest is
committed; `fetch` brings a manifest's missing files back (one download per file however
many starts wait for it). With a remote repository `memory/` is bounded (`trim`: least
recently used first, only committed snapshots nothing pins); a posix_fs repository shares
the bytes by hard link, so there is nothing to trim.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from host.storage.errors import LayerNotFoundError, RepositoryError
from host.storage.repository import OssRepository, PosixFsRepository

from .errors import SandboxStartError, SnapshotCorruptError

log = logging.getLogger(__name__)

MEMORY_KEY = "memory/"  # repository file keys of memory snapshots: memory/<relpath>


class MemoryFiles:
    def __init__(self, memory_dir: Path, repo: PosixFsRepository | OssRepository, *, bound_mib: int) -> None:
        self.dir = memory_dir
        self.repo = repo
        self.bound_mib = bound_mib
        self.fetching: dict[str, asyncio.Lock] = {}  # relpath -> its download
        self.writing: set[str] = set()  # snapshot ids whose memory is being written

    # -- names ----------------------------------------------------------------------------

    def owner(self, path: Path) -> str | None:
        """The snapshot id owning a file under memory/ (its first path component)."""
        try:
            return path.resolve().relative_to(self.dir.resolve()).parts[0]
        except (ValueError, IndexError):
            return None

    def rel(self, path: Path) -> str:
        """`path` (under memory/) as the relative name manifests and repository keys use."""
        return path.resolve().relative_to(self.dir.resolve()).as_posix()

    def path(self, name: str) -> Path:
        """A manifest's memory path on this node (version-1 manifests hold absolute ones)."""
        return self.dir / name

    def owners(self, names: Iterable[str]) -> set[str]:
        return {o for o in (self.owner(self.path(n)) for n in names) if o}

    # -- transfer -------------------------------------------------------------------------

    async def upload(self, own_dir: Path) -> list[str]:
        """Put the files of a new snapshot's own memory dir into the repository (before its
        manifest); returns their relative names."""
        files = sorted(p for p in own_dir.rglob("*") if p.is_file())
        for f in files:
            await asyncio.to_thread(self.repo.put_file, MEMORY_KEY + self.rel(f), f)
        return [self.rel(f) for f in files]

    async def fetch(self, m: dict[str, Any]) -> None:
        """Make every memory file manifest `m` lists present locally."""
        for name in m["memory"].get("files", ()):
            path = self.path(name)
            if path.exists():
                with contextlib.suppress(OSError):  # recently used, for the LRU trim
                    os.utime(self.path(name.split("/", 1)[0]))
                continue
            lock = self.fetching.setdefault(name, asyncio.Lock())
            async with lock:
                if path.exists():
                    continue
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(self.repo.fetch_file, MEMORY_KEY + name, path)
                except LayerNotFoundError as exc:
                    raise SnapshotCorruptError(
                        f"snapshot {m['snapshot_id']}: memory file {name} is missing from "
                        f"the repository") from exc
                except (RepositoryError, OSError) as exc:
                    raise SandboxStartError(
                        f"snapshot {m['snapshot_id']}: fetching memory file {name} from "
                        f"the repository failed: {exc}") from exc
                finally:
                    self.fetching.pop(name, None)
                log.info("fetched %s from the repository in %.2fs (%d bytes)", name,
                         time.perf_counter() - t0, path.stat().st_size)

    async def delete_remote(self, owners: Iterable[str]) -> None:
        for owner in sorted(owners):
            try:
                await asyncio.to_thread(self.repo.delete_files, MEMORY_KEY + owner)
            except (RepositoryError, OSError) as exc:
                log.warning("removing memory of %s from the repository: %s", owner, exc)

    # -- space ----------------------------------------------------------------------------

    def pinned(self, live_dirs: Iterable[Path]) -> set[str]:
        """Snapshot ids whose memory must stay local: what live VMs map (`live_dirs`),
        snapshots being written and files being fetched."""
        pinned: set[str] = set(self.writing)
        pinned |= {name.split("/", 1)[0] for name in self.fetching}
        pinned |= {o for o in (self.owner(p) for p in live_dirs) if o}
        return pinned

    async def gc(self, used: set[str]) -> None:
        """Remove local memory dirs not in `used`."""
        if self.dir.is_dir():
            for d in self.dir.iterdir():
                if d.name not in used:
                    await asyncio.to_thread(shutil.rmtree, d, True)

    async def trim(self, pinned: Callable[[], set[str]],
                   committed: Callable[[str], Awaitable[bool]]) -> None:
        """Evict least recently used memory dirs (not `pinned()`, `committed` in the
        repository) until `memory/` fits its bound. Runs after every start and snapshot:
        asks what is pinned and the repository only when over the bound."""
        if isinstance(self.repo, PosixFsRepository) or not self.dir.is_dir():
            return

        def sizes() -> list[tuple[float, Path, int]]:
            return sorted((d.stat().st_mtime, d,
                           sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file()))
                          for d in self.dir.iterdir())

        dirs = await asyncio.to_thread(sizes)
        total = sum(size for _, _, size in dirs)
        bound = self.bound_mib << 20
        if total <= bound:
            return
        keep = pinned()
        evicted = []
        for _, d, size in dirs:  # least recently used first
            if total <= bound:
                break
            if d.name in keep or not await committed(d.name):
                continue
            await asyncio.to_thread(shutil.rmtree, d, True)
            total -= size
            evicted.append(d.name)
        if evicted:
            log.info("memory cache over %d MiB: evicted %s", self.bound_mib, ", ".join(evicted))
