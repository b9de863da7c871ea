"""`NodeRuntime`: the `SandboxRuntime` of one node (VMM driver + memory snapshots + block
server + network namespaces).

Layout (see `RuntimeConfig`):

    <state_dir>/memory/<snapshot id>/base/      frozen base (templates): base.mem, base.dev
    <state_dir>/memory/<snapshot id>/mem/       memory diff + devstate (pauses, forks)
    <state_dir>/storage/                        the block server's layers and stacks
    <run_dir>/vms/<sandbox id>/                 the VM's work dir (control socket, serial
                                                log, VMM stderr, pid)
    repository: layers, `snapshot-<id>` manifests (the commit point of a snapshot) and the
                memory files as `memory/<path under memory/>`

Stacks are named `sbx-<sandbox id>` (sandboxes) and `tpl-<template id>` (template builds).
This module is the facade; each job lives in its own module (templates, starts,
snapshots, adoption, machines, memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from host.contract import (
    Balloon,
    BuildLog,
    BuildSpec,
    MachineSpec,
    NetworkConfig,
    Placement,
    Reclaim,
    SnapshotRef,
)
from host.network import NetworkError
from host.private import private_dir
from host.storage.cache import CHUNK
from host.storage.errors import StorageError
from host.storage.peers import held_layers, held_range
from host.tasks import cancel_and_wait, run_every
from host.vmm.accel import host_tsc_khz
from host.vmm.errors import VmmError
from host.vmm.proc import rotate_log, tail

from . import adoption, builds, collect, holds, hostimport, snapshots, starts, templates, usage
from .blockd import BlockServerHandle
from .builderstore import Builders
from .compaction import Compactor
from .config import RuntimeConfig
from .errors import NodeRuntimeError, SnapshotNotFoundError
from .forkimages import ForkImages
from .machines import Machines
from .manifests import ManifestStore
from .memory import MemoryFiles, Peers
from .parts import NodeParts
from .sandbox import policy_of

if TYPE_CHECKING:
    from host.metrics import Metrics

log = logging.getLogger(__name__)

# A console log past this is rotated (its newest half kept in `<log>.1`), checked every
# SERIAL_CHECK_S; between checks a jail's RLIMIT_FSIZE is the hard stop.
SERIAL_MAX_BYTES = 1 << 20
SERIAL_CHECK_S = 2.0


def make_dirs(cfg: RuntimeConfig) -> None:
    """The node's dirs, root's only (0700): they hold guest disks and memory, VM work
    dirs and the block server's sockets."""
    for d in (cfg.state_dir, cfg.memory_dir, cfg.chunk_cache_dir, cfg.run_dir, cfg.vms_dir,
              cfg.storage_run_dir):
        private_dir(d)


class NodeRuntime:
    """One node's sandbox runtime. `await NodeRuntime(config).open()` (or `async with`).
    With `metrics`, the service's VM memory and storage usage are read from it at each
    scrape (usage.py)."""

    def __init__(self, config: RuntimeConfig | None = None, *,
                 metrics: Metrics | None = None) -> None:
        self.config = cfg = config or RuntimeConfig()
        block = BlockServerHandle(cfg)
        manifests = ManifestStore(cfg.repository_spec)
        memory = MemoryFiles(cfg.memory_dir, manifests.repo, bound_mib=cfg.memory_cache_mib)
        self.parts = NodeParts(
            config=cfg, block=block, machines=Machines(cfg, block), memory=memory,
            manifests=manifests, compactor=Compactor(block, cfg.max_disk_chain),
            forks=ForkImages(memory, min_mib=cfg.fork_share_min_mib),
            builders=Builders(cfg.state_dir / "builders") if cfg.builders else None)
        self._open = False
        # owned by this runtime: cancelled in aclose(), before anything they could race
        self._tasks: list[asyncio.Task[None]] = []
        if metrics is not None:
            metrics.track_vms(lambda: usage.vm_pids(self.parts))
            metrics.track_storage(lambda: usage.storage_usage(self.parts))

    # -- lifecycle ----------------------------------------------------------------------

    async def open(self) -> Self:
        if self._open:
            return self
        await asyncio.to_thread(make_dirs, self.config)
        # what imports a crash interrupted (raw copies of image filesystems): no build runs yet
        await asyncio.to_thread(hostimport.sweep, self.config.state_dir)
        if self.parts.builders is not None:
            await asyncio.to_thread(self.parts.builders.sweep)
        await self.block.ensure()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.block.watch(), name="block-server-watchdog"))
        await self.parts.machines.open()
        self._tasks.append(loop.create_task(
            run_every(SERIAL_CHECK_S, self._rotate_console_logs, log=log,
                      failed="console log rotation failed"), name="console-log-rotation"))
        if not self.config.owns_repository:  # others may share it: say what this node holds
            self._tasks.append(loop.create_task(
                run_every(holds.PUBLISH_S, lambda: holds.publish(self.parts), log=log,
                          failed="publishing this node's holdings failed"),
                name="holdings"))
        await asyncio.to_thread(host_tsc_khz)  # cached; QEMU under TCG needs it
        self._open = True
        return self

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, *, stop_block_server: bool = False) -> None:
        """Release node resources; running VMs (and their networks, stacks and the block
        server) are left running for adoption, unless `stop_block_server`."""
        await self.parts.settle()
        await self.parts.compactor.aclose()
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
        for sb in list(self.parts.sandboxes.values()):
            with contextlib.suppress(VmmError):  # a VM that died meanwhile: nothing to keep
                await sb.vm.detach()
        self.parts.sandboxes.clear()
        await self.parts.machines.close(keep_networks=True)
        if stop_block_server:
            await self.block.stop()
        self._open = False

    async def _rotate_console_logs(self) -> None:
        """Every VM's console log (sandboxes, warm, kept and build VMs: all the driver's),
        kept bounded with its newest lines: a guest writes it at will."""
        driver = self.parts.machines.driver
        for vm in driver.vms if driver is not None else []:
            try:
                path = vm.serial_log
            except VmmError:  # not started yet
                continue
            try:
                await asyncio.to_thread(rotate_log, path, SERIAL_MAX_BYTES)
            except OSError as exc:  # a VM gone meanwhile, its dir with it
                log.debug("console log %s not rotated: %s", path, exc)

    async def shutdown(self) -> None:
        """Kill every sandbox, remove networks and stop the block server (tests, drain)."""
        await self.parts.settle()
        for sid in list(self.parts.sandboxes):
            with contextlib.suppress(NodeRuntimeError, StorageError, NetworkError):
                await self.kill(sid)
        await self.parts.machines.close(keep_networks=False)
        await self.aclose(stop_block_server=True)

    async def detach(self, sandbox_id: str) -> dict[str, Any]:
        """Forget a live sandbox without touching its VM (hand-over to another runtime
        instance, which `adopt()`s it with the returned facts)."""
        sb = self.parts.get(sandbox_id)
        async with sb.lock:
            facts = sb.facts()
            self.parts.sandboxes.pop(sandbox_id, None)
            await sb.vm.detach()
        return facts

    # -- what the node holds --------------------------------------------------------------

    @property
    def block(self) -> BlockServerHandle:
        return self.parts.block

    @property
    def manifests(self) -> ManifestStore:
        return self.parts.manifests

    @property
    def mode(self) -> str:
        """Networking of this node's VMs: "netns" or "user"."""
        return self.parts.machines.mode

    @property
    def vmm(self) -> str:
        """The VMM driver this node runs ("qemu", "firecracker")."""
        return self.parts.machines.vmm.name

    @property
    def nm(self) -> Any:
        return self.parts.machines.nm

    @property
    def last_timings(self) -> dict[str, float]:
        return self.parts.last_timings

    @property
    def sandboxes(self) -> dict[str, Placement]:
        return {sid: sb.placement() for sid, sb in self.parts.sandboxes.items()}

    def vm_pid(self, sandbox_id: str) -> int:
        pid = self.parts.get(sandbox_id).vm.pid
        if pid is None:
            raise NodeRuntimeError(f"sandbox {sandbox_id}: its VM is not running")
        return pid

    async def balloon(self, sandbox_id: str) -> Balloon | None:
        vm = self.parts.get(sandbox_id).vm
        if not vm.spec.balloon:
            return None
        try:
            st = await vm.balloon_stats()
        except VmmError as exc:
            raise NodeRuntimeError(f"sandbox {sandbox_id}: balloon: {exc}") from exc
        return Balloon(size_mib=st.size_mib, target_mib=st.target_mib,
                       available_mib=st.available_mib, caches_mib=st.caches_mib)

    async def set_balloon(self, sandbox_id: str, amount_mib: int) -> None:
        try:
            await self.parts.get(sandbox_id).vm.set_balloon(amount_mib)
        except VmmError as exc:
            raise NodeRuntimeError(f"sandbox {sandbox_id}: balloon: {exc}") from exc

    def _check_open(self) -> None:
        if not self._open:
            raise NodeRuntimeError("NodeRuntime is not open")

    # -- operations (SandboxRuntime) ------------------------------------------------------

    async def build_template(self, template_id: str, machine: MachineSpec) -> SnapshotRef:
        """Cold-boot `machine.image`, freeze its memory once envd answers, seal its disk."""
        self._check_open()
        return await templates.build_template(self.parts, template_id, machine)

    async def build(self, spec: BuildSpec, log: BuildLog) -> SnapshotRef:
        """Build a template from an image, another template or our base, with steps."""
        self._check_open()
        return await builds.build(self.parts, spec, log)

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False, hold: bool = False, fanout: int = 1) -> Placement:
        """Restore `snapshot` (memory and disk) into a new VM; `reboot`, or a filesystem-only
        snapshot, cold-boots its disk instead (processes and memory are not kept). `hold`:
        restore, then stop its vCPUs until a start of the same id continues it. `fanout`:
        how many starts of `snapshot` the caller makes at once (a fork's children share
        one memory image then: forkimages.py)."""
        self._check_open()
        return await starts.start(self.parts, sandbox_id, snapshot, network, reboot=reboot,
                                  hold=hold, fanout=fanout)

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True, stopped: Callable[[], None] | None = None,
                       keep: bool = False, reclaim: Reclaim | None = None) -> SnapshotRef:
        """Snapshot a running sandbox: memory + disk, or (`memory=False`, only with
        `stop=True`) its disk alone: a filesystem-only pause, resumed by a cold boot.
        `stopped`, `keep`, `reclaim`: see the contract."""
        self._check_open()
        return await snapshots.snapshot(self.parts, sandbox_id, snapshot_id, stop=stop,
                                        memory=memory, stopped=stopped, keep=keep,
                                        reclaim=reclaim)

    async def kill(self, sandbox_id: str) -> None:
        await adoption.kill(self.parts, sandbox_id)

    def exited(self) -> list[str]:
        return [sid for sid, sb in self.parts.sandboxes.items()
                if not sb.held and not sb.lock.locked() and not sb.vm.alive()]

    async def adopt(self, sandbox_id: str, facts: dict[str, Any]) -> Placement | None:
        self._check_open()
        return await adoption.adopt(self.parts, sandbox_id, facts)

    async def reap_orphans(self, known: set[str]) -> list[str]:
        self._check_open()
        return await adoption.reap_orphans(self.parts, known)

    async def salvage(self, sandbox_id: str, facts: dict[str, Any],
                      snapshot_id: str) -> SnapshotRef | None:
        self._check_open()
        return await adoption.salvage(self.parts, sandbox_id, facts, snapshot_id)

    async def listen(self, sandbox_id: str) -> socket.socket:
        sb = self.parts.get(sandbox_id)
        nm = self.parts.machines.nm
        if sb.mode != "netns" or nm is None:
            raise RuntimeError("volume mounts need namespaced networking; this node runs "
                               "user-mode networking (see host/network/probe.py)")
        if sandbox_id not in nm.networks:
            await adoption.adopt_networks(self.parts)
        return await nm.listen(sandbox_id)

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        sb = self.parts.get(sandbox_id)
        policy = policy_of(network)
        nm = self.parts.machines.nm
        if sb.mode == "netns" and nm is not None:
            if sandbox_id not in nm.networks:
                await adoption.adopt_networks(self.parts)
            await nm.update_policy(sandbox_id, policy)
        else:
            log.warning("sandbox %s: user-mode networking does not enforce egress rules",
                        sandbox_id)
        sb.policy = policy

    async def find_snapshot(self, snapshot_id: str) -> SnapshotRef | None:
        """The committed snapshot (its manifest is the commit point), or None."""
        try:
            m = await self.manifests.get(snapshot_id)
        except SnapshotNotFoundError:
            return None
        return SnapshotRef(snapshot_id, MachineSpec(**m["machine"]), float(m["created_at"]),
                           m.get("parent_id"), m)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await snapshots.delete(self.parts, snapshot_id)

    async def collect_storage(self, *, dry_run: bool = False) -> dict[str, Any]:
        return await collect.collect(self.parts, dry_run=dry_run,
                                     min_age_s=self.config.collect_min_age_s)

    async def use_peers(self, peers: Peers) -> None:
        """Fetch memory files from neighbours before the repository (a cluster node's
        `--p2p`), and announce the snapshots whose memory this node holds now."""
        memory = self.parts.memory
        memory.peers = peers
        if memory.dir.is_dir():
            await peers.announce([d.name for d in memory.dir.iterdir()
                                  if d.is_dir() and not d.name.startswith(".")])

    def memory_file(self, name: str) -> Path | None:
        """A memory file this node holds, for a neighbour (MemoryFiles.local)."""
        return self.parts.memory.local(name)

    def held_layers(self) -> set[str]:
        """Layers (sha256 hex) this node can serve bytes of to a neighbour (blocking)."""
        return held_layers(self.config.layers_dir, self.config.chunk_cache_dir)

    def layer_range(self, hexd: str, offset: int, length: int) -> bytes | None:
        """Bytes of a layer for a neighbour's block server, if this node has them
        (blocking: storage/peers.py's held_range)."""
        return held_range(self.config.layers_dir, self.config.chunk_cache_dir, hexd, offset,
                          length, chunk_size=CHUNK)

    @property
    def peers_file(self) -> Path:
        return self.config.peers_file

    # --- shared documents: handoffs, the template catalog (for the other nodes) ------

    async def put_document(self, name: str, doc: dict[str, Any]) -> None:
        await self.manifests.put_doc(name, doc)

    async def get_document(self, name: str) -> dict[str, Any] | None:
        return await self.manifests.get_doc(name)

    async def delete_document(self, name: str) -> None:
        await self.manifests.delete_doc(name)

    async def console_log(self, sandbox_id: str, limit: int = 1000) -> list[str]:
        sb = self.parts.get(sandbox_id)
        text = await asyncio.to_thread(tail, sb.vm.serial_log, limit, 4 * 1024 * 1024)
        return text.splitlines()
