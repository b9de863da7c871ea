"""Snapshots of running sandboxes (pause, fork, named snapshots) and their deletion.

Memory and disk are cut at the same instant: the disk upper is sealed while the guest is
stopped for the memory capture. A snapshot that keeps the sandbox running resumes it right
after; the diff is written, the new layer pushed and the memory uploaded while the guest
runs. Three kinds: an incremental memory diff (a VM restored from a base), a new frozen
base (a cold-booted VM), or the disk alone (`memory=False`, a filesystem-only pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from host.contract import Reclaim, SnapshotRef
from host.storage.errors import StorageError
from host.vmm.driver import REPORTING_DELAY_MS
from host.vmm.memsnap import BaseImage, MemSnapshot

from .errors import NodeRuntimeError, SandboxNotFoundError, SnapshotNotFoundError
from .manifests import VERSION
from .parts import NodeParts
from .sandbox import RunningSandbox, boot_of
from .starts import stages

log = logging.getLogger(__name__)

Seal = Callable[[], Awaitable[None]]
RECLAIM_MIN_PRIVATE_MIB = 64
# A guest's free-page reports start at 16 MiB of free 512 KiB blocks: less freed than
# that may never come back, and waiting for it would only delay the snapshot
RECLAIM_MIN_FREED_MIB = 16
RECLAIM_WAIT_S = 2.0
# reports come a run every REPORTING_DELAY_MS while there is more: 3 runs with nothing
RECLAIM_QUIET_S = 3 * REPORTING_DELAY_MS / 1000


async def snapshot(p: NodeParts, sandbox_id: str, snapshot_id: str, *, stop: bool,
                   memory: bool, stopped: Callable[[], None] | None = None,
                   keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
    sb = p.get(sandbox_id)
    async with sb.lock:
        if p.sandboxes.get(sandbox_id) is not sb:
            raise SandboxNotFoundError(f"sandbox {sandbox_id} went away")
        p.memory.writing.add(snapshot_id)
        try:
            ref = await _snapshot(p, sb, snapshot_id, stop=stop, memory=memory,
                                  stopped=stopped, keep=keep, reclaim=reclaim)
        finally:
            p.memory.writing.discard(snapshot_id)
    await p.trim_memory()
    return ref


@dataclasses.dataclass
class _Cut:
    """What one snapshot captured while the guest was stopped: the memory record (None
    for a disk-only snapshot), the VM's memory lineage after it, the sealed disk layer."""

    mem: dict[str, Any] | None
    memsnap_dir: Path | None
    base_dir: Path | None
    layer: str


class _Sealer:
    """Seals the sandbox's disk upper once, at the instant the memory capture chooses
    (while the guest is stopped), and times it."""

    def __init__(self, p: NodeParts, sb: RunningSandbox, timings: dict[str, float]) -> None:
        self.p, self.sb, self.timings = p, sb, timings
        self.layer: str | None = None

    async def __call__(self) -> None:
        t = time.perf_counter()
        self.layer = await self.p.block.client.seal(self.sb.stack, upload=False)
        self.timings["seal_s"] = time.perf_counter() - t


async def _snapshot(p: NodeParts, sb: RunningSandbox, snapshot_id: str, *, stop: bool,
                    memory: bool, stopped: Callable[[], None] | None,
                    keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
    """Cut memory and disk at one instant, publish them, commit the manifest, then let the
    VM go (a pause) or go on from this snapshot (a live snapshot, a kept VM)."""
    t0 = time.perf_counter()
    root = p.memory.dir / snapshot_id
    await _check_new(p, snapshot_id, root, stop=stop, memory=memory)
    timings: dict[str, float] = {}
    try:
        await _prehash(p, sb)
        if memory and sb.scratch is None and reclaim is not None:
            await _reclaim(sb, reclaim, timings)
        cut = await _cut(p, sb, root, stop=stop, memory=memory, stopped=stopped,
                         timings=timings)
        disk = await _publish(p, sb, root, cut, timings)
        m = await _manifest(p, sb, snapshot_id, cut, disk)
        timings["total_s"] = time.perf_counter() - t0
        m["timings"] = {k: round(v, 4) for k, v in timings.items()}
        await p.manifests.put(snapshot_id, m)  # the commit point
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        await _after_failure(p, sb, stop=stop)
        raise
    p.last_timings = timings
    log.info("sandbox %s: snapshot %s (%s) in %.0f ms: %s; %d memory pages", sb.sandbox_id,
             snapshot_id, "pause" if stop else "live", timings["total_s"] * 1e3,
             stages(timings), int(timings.get("diff_pages", 0)))
    await _after_commit(p, sb, snapshot_id, cut, stop=stop, keep=keep)
    return SnapshotRef(snapshot_id, sb.machine, m["created_at"], m["parent_id"], m)


async def _prehash(p: NodeParts, sb: RunningSandbox) -> None:
    """The seal comes while the guest is stopped: the block server hashes the disk upper
    from now on (guest writes rewrote blocks in place, so its running digest may be
    stale), beside the reclaim and the memory capture. Only an optimisation: on failure
    the seal hashes it."""
    try:
        await p.block.client.prehash(sb.stack)
    except StorageError as exc:
        log.warning("sandbox %s: prehash of the disk upper: %s", sb.sandbox_id, exc)


async def _reclaim(sb: RunningSandbox, reclaim: Reclaim, timings: dict[str, float]) -> None:
    """Have the guest drop its page cache and give it back before the cut: what it keeps
    is copied into the diff and into every restore of it (a fork's 16 children). Asked
    only of a guest whose RAM differs from its base by RECLAIM_MIN_PRIVATE_MIB or more
    (an idle one's ~12 MiB is not worth a call into it); then waits, at most
    RECLAIM_WAIT_S, until its private memory fell by 90 % of what it freed, or stopped
    falling for RECLAIM_QUIET_S (its reports are done)."""
    vm = sb.vm
    if not vm.spec.balloon or not vm.alive():
        return
    t0 = time.perf_counter()
    before = await vm.private_memory_mib()
    if before is not None and before < RECLAIM_MIN_PRIVATE_MIB:
        return
    freed = min(await reclaim(), vm.spec.mem_mib)  # the guest's word, bounded by its RAM
    timings["reclaim_ask_s"] = time.perf_counter() - t0
    timings["freed_mib"] = float(freed)
    if before is None or freed < RECLAIM_MIN_FREED_MIB:
        return
    loop = asyncio.get_running_loop()
    low, start = before, loop.time()
    last = start
    while loop.time() - start < RECLAIM_WAIT_S:
        now = await vm.private_memory_mib()
        if now is None:
            break
        if now < low:
            low, last = now, loop.time()
        if (before - low) * 10 >= min(freed, before) * 9 or loop.time() - last >= RECLAIM_QUIET_S:
            break
        await asyncio.sleep(0.02)
    timings["returned_mib"] = float(before - low)
    timings["reclaim_s"] = time.perf_counter() - t0


async def _check_new(p: NodeParts, snapshot_id: str, root: Path, *, stop: bool,
                     memory: bool) -> None:
    if await p.committed(snapshot_id):
        raise NodeRuntimeError(f"snapshot {snapshot_id} already exists")
    if not memory and not stop:
        raise NodeRuntimeError("a filesystem-only snapshot stops the sandbox (stop=True)")
    if root.exists():  # leftovers of an uncommitted attempt
        shutil.rmtree(root)


async def _cut(p: NodeParts, sb: RunningSandbox, root: Path, *, stop: bool, memory: bool,
               stopped: Callable[[], None] | None, timings: dict[str, float]) -> _Cut:
    """Stop the guest (a pause), then capture its memory and seal its disk while it
    cannot change either; a live snapshot's guest runs again as soon as both are cut."""
    vm = sb.vm
    seal = _Sealer(p, sb, timings)
    t_stop = time.perf_counter()
    if stop:
        if vm.alive():
            await vm.pause()
        # else: the VM died by itself; its disk (the block server's upper) is intact
        # and is what this snapshot keeps (the watchdog's salvage, timeouts.vm_exited)
        timings["stop_s"] = time.perf_counter() - t_stop
        if stopped is not None:  # nothing the guest does can change this snapshot now
            stopped()
    if not memory:
        await seal()
        mem, memsnap_dir, base_dir = None, None, sb.base_dir
    elif sb.scratch is not None:
        mem, base_dir = await _freeze(p, sb, root, seal, timings)
        memsnap_dir = None
        if not stop:
            await vm.resume()
            timings["downtime_s"] = time.perf_counter() - t_stop
    else:
        mem, memsnap_dir = await _incremental(p, sb, root, seal, stop, timings)
        base_dir = sb.base_dir
    timings["memory_s"] = time.perf_counter() - t_stop
    assert seal.layer is not None
    return _Cut(mem=mem, memsnap_dir=memsnap_dir, base_dir=base_dir, layer=seal.layer)


async def _publish(p: NodeParts, sb: RunningSandbox, root: Path, cut: _Cut,
                   timings: dict[str, float]) -> Any:
    """Push the sealed layer and upload the memory files (the guest may run meanwhile);
    records in `cut.mem` every file a restore needs and the sha256 a fetch checks.
    Returns the stack's info (its layers as the manifest records them)."""
    t_mem = time.perf_counter()
    await p.block.client.push(cut.layer)
    info = await p.block.client.info(sb.stack)
    timings["push_s"] = time.perf_counter() - t_mem
    if cut.mem is not None:
        t_up = time.perf_counter()
        own = await p.memory.upload(root)
        timings["upload_memory_s"] = time.perf_counter() - t_up
        cut.mem["files"] = sorted({*cut.mem["files"], *own})
        # what a fetch checks: this snapshot's files as uploaded, the older ones
        # (base, parent diffs) as recorded when they were
        known = {**sb.memory_sha256, **{n: h for n, h in own.items() if h}}
        cut.mem["sha256"] = {n: known[n] for n in cut.mem["files"] if n in known}
    return info


async def _manifest(p: NodeParts, sb: RunningSandbox, snapshot_id: str, cut: _Cut,
                    disk: Any) -> dict[str, Any]:
    mem = cut.mem
    depends = p.memory.owners((mem or {}).get("files", ())) | {snapshot_id}
    boot = sb.boot or boot_of(await p.manifests.get(sb.snapshot_id))  # old facts
    return {
        "version": VERSION, "kind": "snapshot" if mem else "disk",
        "snapshot_id": snapshot_id, "created_at": time.time(),
        "parent_id": sb.snapshot_id, "sandbox_id": sb.sandbox_id,
        "machine": dataclasses.asdict(sb.machine), "network_mode": sb.mode, **boot,
        "config_sha256": sb.config_sha256, "memory": mem,
        # what restores of this memory must run under (starts.check_vmm)
        **({"vmm": sb.vmm} if mem is not None and sb.vmm else {}),
        "disk": {"layers": list(disk.layers), "virtual_size": disk.virtual_size,
                 **({"base": sb.disk_base} if sb.disk_base is not None else {})},
        "depends_on": sorted(depends),
    }


async def _after_commit(p: NodeParts, sb: RunningSandbox, snapshot_id: str, cut: _Cut, *,
                        stop: bool, keep: bool) -> None:
    if stop and not (keep and cut.mem is not None and sb.vm.alive()):
        # committed: the network and stack go after the caller has its answer
        await p.release(sb, wait=False)
        return
    # The VM goes on from this snapshot: running (a live snapshot), or stopped and
    # kept (`keep`: its disk stack already writes over the sealed layer, its memory
    # is this snapshot's), so a resume continues it instead of restoring.
    sb.held = stop
    sb.base_dir, sb.memsnap_dir = cut.base_dir, cut.memsnap_dir
    sb.snapshot_id = snapshot_id
    if cut.mem is not None:
        sb.memory_sha256 = dict(cut.mem["sha256"])
    p.compactor.request(sb)


async def _after_failure(p: NodeParts, sb: RunningSandbox, *, stop: bool) -> None:
    """A failed snapshot leaves the guest running if its VM lives (a pause that failed
    keeps the sandbox running). A VM that died meanwhile (or no longer answers, and is
    killed) leaves the sandbox registered with its disk: its stack's upper holds what
    the guest wrote since its last snapshot, which a disk-only snapshot keeps (the
    orchestrator's pause does that at once, the watchdog otherwise: `exited()`)."""
    dead = not sb.vm.alive()
    if not dead:
        try:
            await sb.vm.resume()
        except Exception:  # noqa: BLE001 - control channel gone: the sandbox is unusable
            dead = True
            with contextlib.suppress(Exception):
                await sb.vm.kill()
    if dead:
        log.warning("sandbox %s: the VM died during a snapshot; its disk is kept for a "
                    "disk-only snapshot", sb.sandbox_id)


async def _incremental(p: NodeParts, sb: RunningSandbox, root: Path, seal: Seal, stop: bool,
                       timings: dict[str, float]) -> tuple[dict[str, Any], Path]:
    """Memory diff against the restored chain (the VM maps its base privately)."""
    assert sb.base_dir is not None
    mem = p.memory
    base = await asyncio.to_thread(BaseImage.load, sb.base_dir)
    parent = (await asyncio.to_thread(MemSnapshot.load, sb.memsnap_dir)
              if sb.memsnap_dir is not None else None)
    snap = await sb.vm.snapshot_memory(root / "mem", base=base, parent=parent,
                                       resume=not stop, max_chain=p.config.max_chain,
                                       while_stopped=seal)
    timings.update({"downtime_s": snap.stats.get("downtime_ms", 0.0) / 1e3,
                    "diff_pages": float(snap.stats.get("diff_pages", 0)),
                    "chain_len": float(snap.stats.get("chain_len", 0))})
    base_files = [mem.rel(f) for f in base.dir.iterdir() if f.is_file()]
    return ({"base_dir": mem.rel(base.dir), "base_id": base.id,
             "snapshot_dir": mem.rel(snap.dir), "devstate": mem.rel(snap.devstate),
             "diffs": [mem.rel(d) for d in snap.diffs],
             "files": [*base_files, *(mem.rel(d) for d in snap.diffs)]}, snap.dir)


async def _freeze(p: NodeParts, sb: RunningSandbox, root: Path, seal: Seal,
                  timings: dict[str, float]) -> tuple[dict[str, Any], Path]:
    """A cold-booted VM (RAM in a share=on file) has no base to diff against: freeze a
    new one from its RAM (a full copy, like a template build). Leaves it paused."""
    t = time.perf_counter()
    base = await sb.vm.freeze_memory(root / "base")
    timings["freeze_s"] = time.perf_counter() - t
    await seal()
    mem = p.memory
    return ({"base_dir": mem.rel(base.dir), "base_id": base.id, "snapshot_dir": None,
             "devstate": mem.rel(base.template_path), "files": []}, base.dir)


async def delete(p: NodeParts, snapshot_id: str) -> None:
    """Remove the manifest, then every memory dir no manifest or live sandbox uses: the
    local copies, and the repository's where this node uploaded them (or owns the
    repository); a dir another node uploaded is its to delete. Disk layers go with the
    next collection (collect.py)."""
    gone: set[str] = {snapshot_id}
    with contextlib.suppress(SnapshotNotFoundError):
        gone |= set((await p.manifests.get(snapshot_id)).get("depends_on", ()))
    await p.manifests.delete(snapshot_id)
    used, _ = await p.gc_memory()
    gone -= used
    if not p.config.owns_repository:
        gone = p.memory.uploaded(gone)
    await p.memory.delete_remote(gone)
