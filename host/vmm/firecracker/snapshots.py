"""Snapshots of a `FirecrackerVm`: memory snapshots in memsnap's form, and whole-VM files.

`freeze_memory` (PUT /snapshot/create Full -> a memsnap base), `snapshot_memory`
(pause, PUT /snapshot/create Diff, `while_stopped`, resume, then convert the sparse diff
into a memsnap diff on the chain) and the restore side used by
`FirecrackerDriver.restore_memory` (verify every file, materialise base + chain into a
private memory file, PUT /snapshot/load). The file conversions are in
memory.py; memsnap errors become `VmmSnapshotError` here.

A Diff snapshot holds the pages dirtied since the last snapshot *or load*: the VM keeps
its `Lineage` (the base and snapshot its memory equalled at that moment) so every diff
lands on the right chain. Any snapshot resets Firecracker's dirty log, so one that is
not turned into a memsnap snapshot (a failed conversion, `save_state`) ends the lineage:
later `snapshot_memory` calls raise until the VM is frozen or restored again.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..driver import VmState
from ..errors import VmmStateError, memory_snapshot_errors
from ..memsnap import BaseImage, MemSnapError, MemSnapshot
from . import memory as fcmem
from .config import FirecrackerHost

if TYPE_CHECKING:
    from ..vmbase import VmBase as _Base
    from .jailer import HostRoot
else:
    _Base = object

_SNAPSHOT_S = 120.0
_MEM_REL = "mem/guest.mem"


def snapshot_mem_path(state: Path) -> Path:
    """Where `save_state(state)` writes guest memory (Firecracker keeps it in its own file)."""
    return state.with_name(state.name + ".mem")




class MemoryMixin(_Base):
    """The snapshot half of `FirecrackerVm` (which provides `api`, `root`, `pause`...)."""

    _driver: FirecrackerHost

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._lineage: fcmem.Lineage | None = None
        self._tracking = False  # KVM dirty-page logging is on in this process
        self._config_sha256: str | None = None
        self.restore_stats: dict[str, float] = {}

    # provided by FirecrackerVm
    @property
    def root(self) -> HostRoot:
        raise NotImplementedError

    async def api(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                  timeout_s: float = 10.0) -> Any:
        raise NotImplementedError

    async def pause(self) -> None:
        raise NotImplementedError

    async def resume(self) -> None:
        raise NotImplementedError

    # -- common ---------------------------------------------------------------------------

    @property
    def config_sha256(self) -> str:
        """What memory snapshots of this VM are keyed on (`FirecrackerDriver.config_digest`)."""
        if self._config_sha256 is None:
            self._config_sha256 = self._driver.config_digest(self._spec)
        return self._config_sha256

    async def _create(self, dest: Path, *, kind: str, state: str, mem: str
                      ) -> tuple[Path, Path, str]:
        """PUT /snapshot/create writing `state` and `mem` for `dest` (the VM must be
        paused): (host path of state, of mem, output to drop once they are used)."""
        rel, host = await self.root.output(dest)
        try:
            await self.api("PUT", "/snapshot/create", {
                "snapshot_type": kind, "snapshot_path": f"{rel}/{state}",
                "mem_file_path": f"{rel}/{mem}"}, timeout_s=_SNAPSHOT_S)
        except BaseException:
            await self.root.drop_output(rel)
            raise
        self._lineage = None  # the dirty log was reset: see the module docstring
        return host / state, host / mem, rel

    async def save_state(self, dest: Path, *, diff: bool = False) -> None:
        """Snapshot into `dest` (device state) and `snapshot_mem_path(dest)` (memory); the
        VM is left PAUSED. diff=True writes only pages dirtied since the last snapshot
        (with track_dirty_pages): merge it onto its base before restoring. Ends the
        memory lineage (see the module docstring)."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        dest = Path(dest)
        await self.pause()
        state, mem, rel = await self._create(dest.parent, kind="Diff" if diff else "Full",
                                             state=dest.name,
                                             mem=snapshot_mem_path(dest).name)
        try:
            for src, dst in ((state, dest), (mem, snapshot_mem_path(dest))):
                if src != dst:
                    await asyncio.to_thread(shutil.move, src, dst)
        finally:
            await self.root.drop_output(rel)

    # -- memory snapshots ---------------------------------------------------------------

    async def freeze_memory(self, dest: Path) -> BaseImage:
        """Full snapshot -> a new memsnap base in `dest`; the VM is left PAUSED. RAM need
        not be in a shared file: Firecracker writes it out."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        await self.pause()
        t0 = time.perf_counter()
        state, mem, rel = await self._create(dest, kind="Full", state=fcmem.BASE_TEMPLATE,
                                             mem=fcmem.FULL_MEM)
        try:
            with memory_snapshot_errors(f"{self._spec.name}: freezing memory into {dest}"):
                base = await asyncio.to_thread(fcmem.freeze_files, dest, full_mem=mem,
                                               vmstate=state, t0=t0)
        finally:
            await self.root.drop_output(rel)
        self._lineage = fcmem.Lineage(base, None)
        return base

    async def snapshot_memory(
        self, dest: Path, *, base: BaseImage, parent: MemSnapshot | None,
        resume: bool = True, max_chain: int = 8,
        while_stopped: Callable[[], Awaitable[None]] | None = None,
    ) -> MemSnapshot:
        """Diff snapshot -> a memsnap snapshot in `dest` on `parent`'s chain (or
        cumulative past `max_chain`). Needs dirty-page tracking and a VM started by
        `restore_memory` or frozen by `freeze_memory`."""
        self._require(VmState.RUNNING, VmState.PAUSED)
        name = self._spec.name
        lineage = self._lineage
        if not self._tracking:
            raise VmmStateError(f"{name}: memory snapshots need dirty-page tracking "
                                "(FirecrackerDriver(track_dirty_pages=True))")
        if lineage is None:
            raise VmmStateError(f"{name}: no memory lineage: the VM was not started by "
                                "restore_memory or frozen by freeze_memory, or a snapshot "
                                "since then was not a memory snapshot")
        with memory_snapshot_errors(f"{name}: memory snapshot into {dest}"):
            await asyncio.to_thread(lineage.check, base, parent)
        config = bytes.fromhex(await self._config_digest())
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        t_call = time.perf_counter()
        was_running = self._state is VmState.RUNNING
        await self.pause()
        t_stop = time.perf_counter()
        created: tuple[Path, Path, str] | None = None
        try:
            created = await self._create(dest, kind="Diff", state=fcmem.DEVSTATE,
                                         mem=fcmem.DIFF_MEM)
            t_created = time.perf_counter()
            if while_stopped is not None:
                await while_stopped()
        except BaseException:
            if created is not None:  # no snapshot after all: drop Firecracker's files
                created[0].unlink(missing_ok=True)
                created[1].unlink(missing_ok=True)
                await self.root.drop_output(created[2])
            raise
        finally:
            if resume and was_running:
                await self.resume()
        state, mem, rel = created
        t_cont = time.perf_counter()
        stats = {"downtime_ms": (t_cont - t_stop) * 1e3,
                 "create_ms": (t_created - t_stop) * 1e3,
                 "while_stopped_ms": (t_cont - t_created) * 1e3}
        try:
            with memory_snapshot_errors(f"{name}: memory snapshot into {dest}"):
                snap = await asyncio.to_thread(
                    fcmem.write_snapshot, dest, diff_mem=mem, vmstate=state, lineage=lineage,
                    base=base, parent=parent, config_sha256=config, max_chain=max_chain,
                    stats=stats, t_call=t_call)
        finally:
            await self.root.drop_output(rel)
        self._lineage = fcmem.Lineage(base, snap)
        return snap

    # -- restore (called by FirecrackerVm._start) -----------------------------------------

    async def _config_digest(self) -> str:
        # The first call per binary runs `firecracker --version`: off the event loop.
        return await asyncio.to_thread(lambda: self.config_sha256)

    async def _verify_restore(self, base: BaseImage, snapshot: MemSnapshot | None) -> None:
        t0 = time.perf_counter()
        config = bytes.fromhex(await self._config_digest())
        with memory_snapshot_errors(f"{self._spec.name}: restore from "
                     f"{snapshot.dir if snapshot else base.dir}"):
            await asyncio.to_thread(fcmem.verify_restore, base, snapshot, config)
        self.restore_stats["verify_ms"] = (time.perf_counter() - t0) * 1e3

    async def _prepare_memory(self, base: BaseImage, snapshot: MemSnapshot | None
                              ) -> tuple[str, str]:
        """(state, memory) paths for PUT /snapshot/load: the bare base as it is, or base +
        chain materialised into a private file in the work dir."""
        t0 = time.perf_counter()
        if snapshot is None:
            mem = await self.root.expose(base.mem_path, _MEM_REL)
            state = await self.root.expose(base.template_path, "state/vmstate")
        else:
            target = self.root.place(_MEM_REL)
            with memory_snapshot_errors(f"{self._spec.name}: restore from {snapshot.dir}"):
                pages = await asyncio.to_thread(fcmem.materialise, base, snapshot, target)
            self.root.let_read(target)
            self.restore_stats["pages"] = float(pages)
            mem = _MEM_REL
            state = await self.root.expose(snapshot.devstate, "state/vmstate")
        self.restore_stats["materialise_ms"] = (time.perf_counter() - t0) * 1e3
        self._lineage = fcmem.Lineage(base, snapshot)
        return state, mem

    # -- facts ------------------------------------------------------------------------------

    def _memory_facts(self) -> dict[str, Any]:
        lin = self._lineage
        return {"config_sha256": self.config_sha256, "tracking": self._tracking,
                "lineage": None if lin is None else {
                    "base": str(lin.base.dir),
                    "head": str(lin.head.dir) if lin.head is not None else None}}

    def _adopt_memory(self, facts: dict[str, Any]) -> None:
        self._config_sha256 = facts.get("config_sha256") or None
        self._tracking = bool(facts.get("tracking"))
        lin = facts.get("lineage")
        if lin:
            try:
                self._lineage = fcmem.Lineage(
                    BaseImage.load(lin["base"]),
                    MemSnapshot.load(lin["head"]) if lin.get("head") else None)
            except MemSnapError as exc:
                self._log.warning("%s: memory lineage lost on adopt: %s", self._spec.name, exc)
