"""`MemoryFiles`: the node's `memory/` dir as a cache of the repository's memory files.

Layout: `memory/<snapshot id>/base/` (frozen bases) and `memory/<snapshot id>/mem/`
(diffs + device state). Manifests name files relative to `memory/`; in the repository
they live as `memory/<relpath>`. A snapshot's files are uploaded before its manifest is
committed; `fetch` brings a manifest's missing files back (one download per file however
many starts wait for it), each checked against the sha256 the manifest records for it
(`memory.sha256`, computed during the upload; manifests without one are not checked).
With a remote repository `memory/` is bounded (`trim`: least recently used first, only
committed snapshots nothing pins); a posix_fs repository shares the bytes by hard link,
so there is nothing to trim. A start `pin`s the files it restores from, from before their
fetch until its VM maps them, so another start's trim cannot evict them in between.
With `peers` (a cluster node's `--p2p`), a missing file is asked of the neighbours that
announced its snapshot first, and what this node holds is announced to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import stat
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from host.storage.collect import Swept, counted
from host.storage.errors import IntegrityError, LayerNotFoundError, RepositoryError
from host.storage.repository import OssRepository, PosixFsRepository

from .errors import SandboxStartError, SnapshotCorruptError

log = logging.getLogger(__name__)

MEMORY_KEY = "memory/"  # repository file keys of memory snapshots: memory/<relpath>
# memory/.own/<snapshot id>: this node uploaded that snapshot's memory, so its repository
# copy is this node's to delete once nothing needs it (kept apart from the cached dirs,
# which trim evicts: ownership outlives the local copy)
OWN_DIR = ".own"


class Peers(Protocol):
    """Neighbours that may hold memory files (host/cluster/peers.py's `PeerFiles`, with
    `--p2p`): asked before the repository; told what this node holds."""

    async def fetch(self, name: str, dest: Path, sha256: str) -> bool:
        """`name` from a neighbour into `dest` (atomically, its content matching
        `sha256`); False when none had it whole."""
        ...

    async def announce(self, owners: Iterable[str]) -> None: ...

    async def withdraw(self, owners: Iterable[str]) -> None: ...


class MemoryFiles:
    def __init__(self, memory_dir: Path, repo: PosixFsRepository | OssRepository, *, bound_mib: int) -> None:
        self.dir = memory_dir
        self.repo = repo
        self.bound_mib = bound_mib
        self.peers: Peers | None = None  # with --p2p in a cluster (use_peers)
        self.peer_hits = 0  # files fetched from a neighbour instead of the repository
        self.fetching: dict[str, asyncio.Lock] = {}  # relpath -> its download
        self.writing: set[str] = set()  # snapshot ids whose memory is being written
        self.pins: Counter[str] = Counter()  # snapshot id -> starts restoring from it
        self.hits = 0    # files a start found here (metrics: aenv_cache_hits_total)
        self.misses = 0  # files it fetched from the repository

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

    def local(self, name: str) -> Path | None:
        """The file `name` (relative to memory/, as manifests write it) if this node holds
        it; None when absent, not a regular file, or outside memory/ (`..`, symlinks)."""
        root = self.dir.resolve()
        path = (root / name).resolve()
        if not path.is_relative_to(root) or path == root or not path.is_file() or \
                path.name.startswith("."):
            return None
        return path

    def owners(self, names: Iterable[str]) -> set[str]:
        return {o for o in (self.owner(self.path(n)) for n in names) if o}

    def needed(self, m: dict[str, Any]) -> set[str]:
        """The snapshot ids whose memory dirs a restore of manifest `m` reads."""
        mem = m.get("memory") or {}
        names = [*mem.get("files", ()),
                 *(mem[k] for k in ("base_dir", "snapshot_dir") if mem.get(k))]
        return self.owners(names)

    # -- transfer -------------------------------------------------------------------------

    async def upload(self, own_dir: Path) -> dict[str, str | None]:
        """Put the files of a new snapshot's own memory dir into the repository (before its
        manifest); returns {relative name: sha256 of its content, or None when the
        repository shares the bytes instead of copying them (posix_fs)}."""
        files = sorted(p for p in own_dir.rglob("*") if p.is_file())
        out: dict[str, str | None] = {}
        await asyncio.to_thread(self._own, self.owners(self.rel(f) for f in files))
        for f in files:
            name = self.rel(f)
            out[name] = await asyncio.to_thread(self.repo.put_file, MEMORY_KEY + name, f)
        if self.peers is not None:   # the snapshot ids owning them (own_dir may be base/)
            await self.peers.announce(self.owners(out))
        return out

    async def fetch(self, m: dict[str, Any]) -> None:
        """Make every memory file manifest `m` lists present locally, each checked against
        its recorded sha256 (a mismatch is fetched again once, then SnapshotCorruptError;
        the bad copy is never left in memory/)."""
        sums: dict[str, str] = m["memory"].get("sha256") or {}
        fetched: list[str] = []
        for name in m["memory"].get("files", ()):
            path = self.path(name)
            if path.exists():
                self.hits += 1
                with contextlib.suppress(OSError):  # recently used, for the LRU trim
                    os.utime(self.path(name.split("/", 1)[0]))
                continue
            lock = self.fetching.setdefault(name, asyncio.Lock())
            async with lock:
                if path.exists():
                    self.hits += 1
                    continue
                self.misses += 1
                fetched.append(name)
                t0 = time.perf_counter()
                try:
                    if await self._from_peer(name, path, sums.get(name)):
                        continue
                    await asyncio.to_thread(self.repo.fetch_file, MEMORY_KEY + name, path,
                                            sha256=sums.get(name))
                except LayerNotFoundError as exc:
                    raise SnapshotCorruptError(
                        f"snapshot {m['snapshot_id']}: memory file {name} is missing from "
                        f"the repository") from exc
                except IntegrityError as exc:
                    raise SnapshotCorruptError(
                        f"snapshot {m['snapshot_id']}: memory file {name} in the repository "
                        f"is damaged (fetched twice): {exc}") from exc
                except (RepositoryError, OSError) as exc:
                    raise SandboxStartError(
                        f"snapshot {m['snapshot_id']}: fetching memory file {name} from "
                        f"the repository failed: {exc}") from exc
                finally:
                    self.fetching.pop(name, None)
                log.info("fetched %s from the repository in %.2fs (%d bytes)", name,
                         time.perf_counter() - t0, path.stat().st_size)
        if fetched and self.peers is not None:   # what was here already was announced
            await self.peers.announce(self.owners(fetched))

    async def _from_peer(self, name: str, path: Path, sha256: str | None) -> bool:
        """From a neighbour first (with --p2p). Only files whose sha256 the manifest
        records: a neighbour's copy is checked against it (posix_fs repositories share
        the bytes and record none: a neighbour has nothing faster to offer there)."""
        if self.peers is None or not sha256:
            return False
        t0 = time.perf_counter()
        if not await self.peers.fetch(name, path, sha256):
            return False
        self.peer_hits += 1
        log.info("fetched %s from a neighbour in %.2fs (%d bytes)", name,
                 time.perf_counter() - t0, path.stat().st_size)
        return True

    def _own(self, owners: Iterable[str]) -> None:
        """Record, before their upload starts, that these snapshots' memory is ours."""
        own = self.dir / OWN_DIR
        own.mkdir(exist_ok=True)
        for owner in owners:
            (own / owner).touch()

    def owned(self) -> set[str]:
        """Every snapshot whose memory this node uploaded and has not deleted (blocking)."""
        own = self.dir / OWN_DIR
        return {m.name for m in own.iterdir()} if own.is_dir() else set()

    def uploaded(self, owners: Iterable[str]) -> set[str]:
        """Those of `owners` whose memory this node uploaded."""
        return {o for o in owners if (self.dir / OWN_DIR / o).exists()}

    async def delete_remote(self, owners: Iterable[str]) -> Swept:
        """Remove the repository's copy of these snapshots' memory; what went."""
        out = Swept()
        for owner in sorted(owners):
            try:
                freed = await asyncio.to_thread(self.repo.delete_files, MEMORY_KEY + owner)
            except (RepositoryError, OSError) as exc:
                log.warning("removing memory of %s from the repository: %s", owner, exc)
                continue
            (self.dir / OWN_DIR / owner).unlink(missing_ok=True)
            out.add_bytes(owner, freed)
        return out

    async def gc_remote(self, used: set[str], *, min_age_s: float,
                        dry_run: bool = False) -> Swept:
        """Remove the repository's copy of the memory this node uploaded (`.own`) that
        no manifest, live VM or start uses (`used`, pins), recorded longer than
        `min_age_s` ago (a pause uploads its memory before its manifest names it).
        Another node's memory is never touched."""
        own = self.dir / OWN_DIR
        cutoff = time.time() - min_age_s

        def unused() -> list[str]:
            out = []
            for marker in own.iterdir() if own.is_dir() else []:
                with contextlib.suppress(OSError):
                    name = marker.name
                    if name not in used and name not in self.pins and \
                            name not in self.writing and marker.stat().st_mtime <= cutoff:
                        out.append(name)
            return out

        owners = await asyncio.to_thread(unused)
        if dry_run:
            return Swept(files=len(owners), digests=owners)
        return await self.delete_remote(owners)

    # -- space ----------------------------------------------------------------------------

    def used_bytes(self) -> int:
        """Bytes `memory/` holds on disk (blocking: walks the dir)."""
        return tree_bytes(self.dir)

    @contextlib.contextmanager
    def pin(self, owners: Iterable[str]) -> Iterator[None]:
        """Keep the memory dirs of `owners` (snapshot ids) out of `trim` and `gc` while
        the block runs; released on every way out (error, cancellation). Pins count: a
        dir stays pinned while any start holds it."""
        with counted(self.pins, owners):
            yield

    def pinned(self, live_dirs: Iterable[Path]) -> set[str]:
        """Snapshot ids whose memory must stay local: what live VMs map (`live_dirs`),
        what starts restore from (`pin`), snapshots being written and files being
        fetched."""
        pinned: set[str] = set(self.writing) | set(self.pins)
        pinned |= {name.split("/", 1)[0] for name in self.fetching}
        pinned |= {o for o in (self.owner(p) for p in live_dirs) if o}
        return pinned

    async def gc(self, used: set[str], *, dry_run: bool = False) -> Swept:
        """Remove local memory dirs not in `used` (nor pinned or being written now);
        returns what went (`dry_run`: would go). A file's bytes count when its last link
        goes (a posix_fs repository's copy is a hard link: `delete_remote` frees it)."""
        out = Swept()
        if self.dir.is_dir():
            for d in self.dir.iterdir():
                if d.name not in used and d.name not in self.pins and \
                        d.name not in self.writing and d.name != OWN_DIR:
                    out.files += 1
                    out.digests.append(d.name)
                    out.bytes += await asyncio.to_thread(tree_bytes, d, unshared=True)
                    if not dry_run:
                        await asyncio.to_thread(shutil.rmtree, d, True)
        if out.digests and not dry_run and self.peers is not None:
            await self.peers.withdraw(out.digests)
        return out

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
                          for d in self.dir.iterdir() if not d.name.startswith("."))

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
            # Asked again after that await, then moved aside with no await in between: a
            # start that pins `d` from now on finds its files gone and fetches them again.
            if d.name in pinned():
                continue
            trash = d.with_name(f".evicted-{d.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(d, trash)
            except OSError as exc:
                log.warning("evicting memory of %s: %s", d.name, exc)
                continue
            await asyncio.to_thread(shutil.rmtree, trash, True)
            total -= size
            evicted.append(d.name)
        if evicted:
            log.info("memory cache over %d MiB: evicted %s", self.bound_mib, ", ".join(evicted))
            if self.peers is not None:
                await self.peers.withdraw(evicted)


def tree_bytes(root: Path, *, unshared: bool = False) -> int:
    """Bytes the files under `root` hold on disk (blocking: walks it; 0 when it does not
    exist); `unshared`: only files no other hard link holds (what removing them frees)."""
    total = 0
    for f in root.rglob("*"):
        with contextlib.suppress(OSError):  # removed meanwhile (gc, trim)
            st = f.lstat()
            if not stat.S_ISDIR(st.st_mode) and (not unshared or st.st_nlink == 1):
                total += st.st_blocks * 512
    return total
