"""`NodeRuntime`: the `SandboxRuntime` of one node (QEMU + memsnap + block server + netns).

Layout (see `RuntimeConfig`):

    <state_dir>/memory/<snapshot id>/base/      frozen base (templates): base.mem, base.dev
    <state_dir>/memory/<snapshot id>/mem/       memory diff + devstate (pauses, forks)
    <state_dir>/storage/                        the block server's layers and stacks
    <run_dir>/vms/<sandbox id>/                 QMP socket, serial log, QEMU stderr, pid
    repository: layers, `snapshot-<id>` manifests (the commit point of a snapshot) and the
                memory files as `memory/<path under memory/>`

The repository is the durable copy; `memory/` is a local cache of it: a snapshot's
manifest lists every memory file it needs (relative to `memory/`), and `start` fetches the
missing ones, so a fresh node (empty state dir) resumes from the repository alone.

Stacks are named `sbx-<sandbox id>` (sandboxes) and `tpl-<template id>` (template builds).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from host.contract import MachineSpec, NetworkConfig, Placement, SnapshotRef
from host.network import (
    NetworkError,
    NetworkManager,
    NetworkManagerConfig,
    NetworkPolicy,
    NetworkUnavailableError,
    SandboxNetwork,
)
from host.storage.errors import (
    LayerNotFoundError,
    RepositoryError,
    StackNotFoundError,
    StorageError,
)
from host.storage.repository import PosixFsRepository
from host.vmm.accel import detect_accel, host_tsc_khz
from host.vmm.driver import ENVD_PORT, MemoryBacking, NbdDisk, TapNet, UserNet, VmSpec
from host.vmm.image import find_image
from host.vmm.memsnap import (
    BaseImage,
    MemSnapError,
    MemSnapshot,
    freeze_base,
    restore_base_into,
    restore_into,
    snapshot_incremental,
)
from host.vmm.proc import free_port, tail
from host.vmm.qemu_cmdline import QemuRunFiles

from .blockd import BlockServerHandle
from .config import RuntimeConfig
from .errors import (
    NodeRuntimeError,
    SandboxNotFoundError,
    SandboxStartError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
)
from .layers import image_layers
from .manifests import VERSION, ManifestStore
from .vmproc import QemuProcess, family_argv, family_digest, is_our_qemu, qemu_pids_under

log = logging.getLogger(__name__)

MEMORY_KEY = "memory/"  # repository file keys of memory snapshots: memory/<relpath>


def _policy(cfg: NetworkConfig) -> NetworkPolicy:
    return NetworkPolicy(allow_internet_access=cfg.allow_internet_access,
                         allow_out=tuple(cfg.allow_out), deny_out=tuple(cfg.deny_out))


def _boot(m: dict[str, Any]) -> dict[str, Any]:
    """What a VM started from manifest `m` boots (carried into its own snapshots, so they
    do not depend on `m` still existing)."""
    return {"image": m.get("image"), "kernel": m["kernel"], "cmdline": m["cmdline"]}


def _policy_dict(p: NetworkPolicy) -> dict[str, Any]:
    return {"allow_internet_access": p.allow_internet_access, "allow_out": list(p.allow_out),
            "deny_out": list(p.deny_out)}


@dataclass
class _Sandbox:
    sandbox_id: str
    vm: QemuProcess
    mode: str                      # "netns" | "user"
    stack: str
    snapshot_id: str               # restored from
    base_dir: Path | None          # memory base it maps (None: cold-booted, see `scratch`)
    memsnap_dir: Path | None       # parent for the next memory delta
    config_sha256: str
    machine: MachineSpec
    envd_host: str
    envd_port: int
    policy: NetworkPolicy
    host_port: int | None = None
    scratch: Path | None = None    # cold-booted: its RAM file (share=on); snapshots freeze it
    boot: dict[str, Any] = field(default_factory=dict)  # image, kernel, cmdline it runs
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timings: dict[str, float] = field(default_factory=dict)

    def facts(self) -> dict[str, Any]:
        f: dict[str, Any] = {
            "pid": self.vm.pid, "work_dir": str(self.vm.work_dir),
            "qmp_socket": str(self.vm.files.qmp_socket), "mode": self.mode,
            "stack": self.stack, "snapshot_id": self.snapshot_id,
            "base_dir": str(self.base_dir) if self.base_dir else None,
            "memsnap_dir": str(self.memsnap_dir) if self.memsnap_dir else None,
            "scratch": str(self.scratch) if self.scratch else None, "boot": self.boot,
            "config_sha256": self.config_sha256, "machine": dataclasses.asdict(self.machine),
            "envd_host": self.envd_host, "envd_port": self.envd_port,
            "policy": _policy_dict(self.policy),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        }
        if self.host_port is not None:
            f["port_forwards"] = {str(ENVD_PORT): self.host_port}
        return f

    def placement(self) -> Placement:
        return Placement(self.sandbox_id, self.envd_host, self.envd_port, self.facts())


class NodeRuntime:
    """One node's sandbox runtime. `await NodeRuntime(config).open()` (or `async with`)."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        self.block = BlockServerHandle(self.config)
        self.manifests = ManifestStore(self.config.repository_spec)
        self.nm: NetworkManager | None = None
        self.mode = "user"
        self._sbx: dict[str, _Sandbox] = {}
        self._busy: set[str] = set()      # sandbox ids being started
        self._building: set[str] = set()  # template ids being built
        self._accel: tuple[str, int | None] | None = None
        self._fetching: dict[str, asyncio.Lock] = {}  # memory relpath -> its download
        self._writing: set[str] = set()  # snapshot ids whose memory is being written
        self._open = False
        self.last_timings: dict[str, float] = {}

    # -- lifecycle --------------------------------------------------------------------

    async def open(self) -> Self:
        if self._open:
            return self
        cfg = self.config
        for d in (cfg.state_dir, cfg.memory_dir, cfg.vms_dir, cfg.storage_run_dir):
            d.mkdir(parents=True, exist_ok=True)
        await self.block.ensure()
        if cfg.network in ("auto", "netns"):
            nm = NetworkManager(NetworkManagerConfig(pool=cfg.network_pool,
                                                     prefix=cfg.network_prefix))
            try:
                await nm.open()
                self.nm, self.mode = nm, "netns"
            except NetworkUnavailableError as exc:
                if cfg.network == "netns":
                    raise NodeRuntimeError(f"network namespaces unavailable: {exc}") from exc
                log.warning("network namespaces unavailable (%s): user-mode networking", exc)
        name = (await asyncio.to_thread(detect_accel, cfg.qemu)).name
        self._accel = (name, await asyncio.to_thread(host_tsc_khz))
        self._open = True
        return self

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, *, stop_block_server: bool = False) -> None:
        """Release node resources; running VMs (and their networks, stacks and the block
        server) are left running for adoption, unless `stop_block_server`."""
        for sb in list(self._sbx.values()):
            await sb.vm.disconnect()
        self._sbx.clear()
        if self.nm is not None:
            with contextlib.suppress(NetworkError):
                await self.nm.aclose(keep_networks=True)
            self.nm = None
        if stop_block_server:
            await self.block.stop()
        self._open = False

    async def shutdown(self) -> None:
        """Kill every sandbox, remove networks and stop the block server (tests, drain)."""
        for sid in list(self._sbx):
            with contextlib.suppress(NodeRuntimeError, StorageError, NetworkError):
                await self.kill(sid)
        if self.nm is not None:
            with contextlib.suppress(NetworkError):
                await self.nm.aclose()
            self.nm = None
        await self.aclose(stop_block_server=True)

    async def detach(self, sandbox_id: str) -> dict[str, Any]:
        """Forget a live sandbox without touching its VM (hand-over to another runtime
        instance, which `adopt()`s it with the returned facts)."""
        sb = self._get(sandbox_id)
        async with sb.lock:
            self._sbx.pop(sandbox_id, None)
            await sb.vm.disconnect()
        return sb.facts()

    @property
    def sandboxes(self) -> dict[str, Placement]:
        return {sid: sb.placement() for sid, sb in self._sbx.items()}

    def vm_pid(self, sandbox_id: str) -> int:
        return self._get(sandbox_id).vm.pid

    # -- helpers ----------------------------------------------------------------------

    def _get(self, sandbox_id: str) -> _Sandbox:
        try:
            return self._sbx[sandbox_id]
        except KeyError:
            raise SandboxNotFoundError(f"no sandbox {sandbox_id} on this node") from None

    def _check_open(self) -> None:
        if not self._open:
            raise NodeRuntimeError("NodeRuntime is not open")

    @property
    def accel(self) -> tuple[str, int | None]:
        assert self._accel is not None
        return self._accel

    def _owner(self, path: Path) -> str | None:
        """The snapshot id owning a file under memory/ (its first path component)."""
        try:
            return path.resolve().relative_to(self.config.memory_dir.resolve()).parts[0]
        except (ValueError, IndexError):
            return None

    def _rel(self, path: Path) -> str:
        """`path` (under memory/) as the relative name manifests and repository keys use."""
        return path.resolve().relative_to(self.config.memory_dir.resolve()).as_posix()

    def _mem(self, name: str) -> Path:
        """A manifest's memory path on this node (version-1 manifests hold absolute ones)."""
        return self.config.memory_dir / name

    async def _upload_memory(self, own_dir: Path) -> list[str]:
        """Put the files of a new snapshot's own memory dir into the repository (before its
        manifest); returns their relative names."""
        files = sorted(p for p in own_dir.rglob("*") if p.is_file())
        repo = self.manifests.repo
        for f in files:
            await asyncio.to_thread(repo.put_file, MEMORY_KEY + self._rel(f), f)
        return [self._rel(f) for f in files]

    async def _fetch_memory(self, m: dict[str, Any]) -> None:
        """Make every memory file the manifest lists present locally, fetching the missing
        ones from the repository (one download per file, however many starts wait on it)."""
        repo = self.manifests.repo
        for name in m["memory"].get("files", ()):
            path = self._mem(name)
            if path.exists():
                with contextlib.suppress(OSError):  # recently used, for the cache's LRU
                    os.utime(self._mem(name.split("/", 1)[0]))
                continue
            lock = self._fetching.setdefault(name, asyncio.Lock())
            async with lock:
                if path.exists():
                    continue
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(repo.fetch_file, MEMORY_KEY + name, path)
                except LayerNotFoundError as exc:
                    raise SnapshotCorruptError(
                        f"snapshot {m['snapshot_id']}: memory file {name} is missing from "
                        f"the repository") from exc
                except (RepositoryError, OSError) as exc:
                    raise SandboxStartError(
                        f"snapshot {m['snapshot_id']}: fetching memory file {name} from "
                        f"the repository failed: {exc}") from exc
                finally:
                    self._fetching.pop(name, None)
                log.info("fetched %s from the repository in %.2fs (%d bytes)", name,
                         time.perf_counter() - t0, path.stat().st_size)

    def _spec(self, m: dict[str, Any], *, name: str, memory: MemoryBacking, stack: str,
              network: TapNet | UserNet) -> VmSpec:
        machine = m["machine"]
        return VmSpec(kernel=Path(m["kernel"]), cmdline=m["cmdline"],
                      vcpus=int(machine["cpu_count"]), mem_mib=int(machine["memory_mb"]),
                      disks=(NbdDisk(socket=self.block.nbd_socket, export=stack),),
                      network=network, memory=memory, name=name)

    async def _make_net(self, sid: str, policy: NetworkPolicy
                        ) -> tuple[SandboxNetwork | None, TapNet | UserNet, str, int, int | None]:
        if self.mode == "netns":
            assert self.nm is not None
            net = await self.nm.create(sid, policy)
            tap = TapNet(tap=net.tap, guest_ip=net.address, netns=net.netns, mac=net.guest.mac)
            return net, tap, net.address, ENVD_PORT, None
        port = free_port()
        return None, UserNet(host_port=port), "127.0.0.1", port, port

    async def _drop_net(self, sid: str) -> None:
        if self.mode == "netns" and self.nm is not None:
            try:
                await self.nm.destroy(sid)
            except NetworkError as exc:
                log.warning("destroying network of %s: %s", sid, exc)

    async def _drop_stack(self, name: str) -> None:
        with contextlib.suppress(StackNotFoundError):
            await self.block.client.delete(name)

    async def _spawn(self, spec: VmSpec, sid: str, *, incoming: bool) -> QemuProcess:
        accel, tsc = self.accel
        work = self.config.vms_dir / sid
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        argv = family_argv(spec, files=QemuRunFiles.in_dir(work), accel=accel, tsc_khz=tsc,
                           host_port=spec.network.host_port if isinstance(spec.network, UserNet)
                           else None, incoming=incoming, qemu=self.config.qemu)
        try:
            vm = await QemuProcess.spawn(argv, name=sid, work_dir=work,
                                         die_with_service=not self.config.vms_survive_service)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return vm

    async def _release_vm(self, vm: QemuProcess) -> None:
        await vm.kill()
        shutil.rmtree(vm.work_dir, ignore_errors=True)

    def _digest(self, spec: VmSpec) -> str:
        accel, tsc = self.accel
        return family_digest(spec, accel=accel, tsc_khz=tsc, qemu=self.config.qemu).hex()

    # -- templates --------------------------------------------------------------------

    async def build_template(self, template_id: str, machine: MachineSpec) -> SnapshotRef:
        """Cold-boot `machine.image` from LSMT layers over NBD with RAM in a share=on file,
        wait for envd, freeze the memory base, seal the disk, commit the manifest."""
        self._check_open()
        if template_id in self._building:
            raise NodeRuntimeError(f"template {template_id} is already being built")
        self._building.add(template_id)
        t0 = time.perf_counter()
        mem_root = self.config.memory_dir / template_id
        stack = f"tpl-{template_id}"
        vm: QemuProcess | None = None
        net_made = False
        timings: dict[str, float] = {}
        try:
            image = await asyncio.to_thread(find_image, machine.image, self.config.image_cache)
            layers = await image_layers(image, self.block.client,
                                        self.config.state_dir / "layers.json")
            timings["layers_s"] = time.perf_counter() - t0
            if mem_root.exists():
                shutil.rmtree(mem_root)
            mem_root.mkdir(parents=True)
            net, network, host, port, _ = await self._make_net(stack, NetworkPolicy())
            net_made = True
            cmdline = image.cmdline + (f" {net.kernel_cmdline()}" if net is not None else "")
            m: dict[str, Any] = {
                "version": VERSION, "kind": "template", "snapshot_id": template_id,
                "machine": dataclasses.asdict(machine), "network_mode": self.mode,
                "image": image.name, "kernel": str(image.kernel.vmlinux),
                "cmdline": cmdline.strip(),
            }
            with contextlib.suppress(StackNotFoundError):
                await self.block.client.delete(stack)
            await self.block.client.create(stack, layers)
            scratch = mem_root / "scratch.mem"
            spec = self._spec(m, name=stack, memory=MemoryBacking(path=scratch, shared=True),
                              stack=stack, network=network)
            t1 = time.perf_counter()
            vm = await self._spawn(spec, stack, incoming=False)
            timings["qmp_ready_s"] = vm.qmp_ready_s or 0.0
            timings["cold_boot_s"] = (await vm.wait_for_envd(
                f"http://{host}:{port}", self.config.boot_timeout_s)) + (vm.qmp_ready_s or 0.0)
            t2 = time.perf_counter()
            assert vm.qmp is not None
            base = await freeze_base(vm.qmp, scratch, mem_root / "base")
            await self.block.client.seal(stack, upload=True)
            info = await self.block.client.info(stack)
            timings["freeze_s"] = time.perf_counter() - t2
            timings["boot_to_frozen_s"] = time.perf_counter() - t1
            await self._release_vm(vm)
            vm = None
            scratch.unlink(missing_ok=True)
            await self._drop_stack(stack)
            await self._drop_net(stack)
            net_made = False
            t3 = time.perf_counter()
            files = await self._upload_memory(base.dir)
            timings["upload_memory_s"] = time.perf_counter() - t3
            m.update({
                "created_at": time.time(), "parent_id": None,
                "config_sha256": self._digest(spec),
                "memory": {"base_dir": self._rel(base.dir), "base_id": base.id,
                           "devstate": self._rel(base.template_path), "snapshot_dir": None,
                           "files": files},
                "disk": {"layers": list(info.layers), "virtual_size": info.virtual_size},
                "depends_on": [template_id],
                "timings": {k: round(v, 3) for k, v in timings.items()},
            })
            await self.manifests.put(template_id, m)
            self.last_timings = timings
            return SnapshotRef(template_id, machine, m["created_at"], None, m)
        except BaseException:
            if vm is not None:
                await self._release_vm(vm)
            with contextlib.suppress(Exception):
                await self._drop_stack(stack)
            if net_made:
                await self._drop_net(stack)
            shutil.rmtree(mem_root, ignore_errors=True)
            raise
        finally:
            self._building.discard(template_id)

    # -- start (restore) --------------------------------------------------------------

    async def start(self, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                    reboot: bool = False) -> Placement:
        """Restore `snapshot` (memory and disk) into a new VM; `reboot`, or a filesystem-only
        snapshot, cold-boots its disk instead (processes and memory are not kept)."""
        self._check_open()
        if sandbox_id in self._sbx or sandbox_id in self._busy:
            raise NodeRuntimeError(f"sandbox {sandbox_id} already exists on this node")
        self._busy.add(sandbox_id)
        try:
            placement = await self._start(sandbox_id, snapshot, network, reboot=reboot)
        finally:
            self._busy.discard(sandbox_id)
        await self._trim_memory_cache()
        return placement

    async def _start(self, sid: str, snapshot: SnapshotRef, network: NetworkConfig, *,
                     reboot: bool) -> Placement:
        t0 = time.perf_counter()
        m = await self.manifests.get(snapshot.snapshot_id)
        if m.get("network_mode") != self.mode:
            raise SandboxStartError(
                f"snapshot {snapshot.snapshot_id} was taken with {m.get('network_mode')} "
                f"networking; this node runs {self.mode}")
        if reboot or m.get("memory") is None:
            return await self._boot(sid, snapshot.snapshot_id, m, network)
        t_fetch = time.perf_counter()
        await self._fetch_memory(m)
        fetch_s = time.perf_counter() - t_fetch
        try:
            base = await asyncio.to_thread(BaseImage.load, self._mem(m["memory"]["base_dir"]))
            memsnap = None
            if m["memory"].get("snapshot_dir"):
                memsnap = await asyncio.to_thread(MemSnapshot.load,
                                                  self._mem(m["memory"]["snapshot_dir"]))
        except MemSnapError as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot.snapshot_id}: {exc}") from exc
        except OSError as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot.snapshot_id}: {exc}") from exc
        policy = _policy(network)
        stack = f"sbx-{sid}"
        machine = MachineSpec(**m["machine"])
        vm: QemuProcess | None = None
        timings: dict[str, float] = {"fetch_memory_s": fetch_s}
        vnet, host, port, host_port = await self._provision(sid, m["disk"]["layers"], policy)
        try:
            spec = self._spec(m, name=sid, memory=MemoryBacking(path=base.mem_path, shared=False),
                              stack=stack, network=vnet)
            digest = self._digest(spec)
            if digest != m["config_sha256"]:
                raise SandboxStartError(
                    f"snapshot {snapshot.snapshot_id} was taken with another QEMU configuration "
                    f"(kernel, cmdline, machine or QEMU flags differ on this node)")
            t1 = time.perf_counter()
            timings["prepare_s"] = t1 - t0
            vm = await self._spawn(spec, sid, incoming=True)
            timings["qmp_ready_s"] = vm.qmp_ready_s or 0.0
            assert vm.qmp is not None
            t2 = time.perf_counter()
            try:
                if memsnap is None:
                    await restore_base_into(vm.qmp, vm.pid, base.mem_path, base)
                else:
                    await restore_into(vm.qmp, vm.pid, base.mem_path, memsnap, base,
                                       config_sha256=bytes.fromhex(m["config_sha256"]))
            except MemSnapError as exc:
                raise SnapshotCorruptError(
                    f"restore of snapshot {snapshot.snapshot_id} failed: {exc}") from exc
            t3 = time.perf_counter()
            timings["restore_s"] = t3 - t2
            timings["envd_s"] = await vm.wait_for_envd(f"http://{host}:{port}",
                                                       self.config.envd_timeout_s)
            timings["total_s"] = time.perf_counter() - t0
            sb = _Sandbox(sandbox_id=sid, vm=vm, mode=self.mode, stack=stack, boot=_boot(m),
                          snapshot_id=snapshot.snapshot_id, base_dir=base.dir,
                          memsnap_dir=memsnap.dir if memsnap is not None else None,
                          config_sha256=m["config_sha256"], machine=machine, envd_host=host,
                          envd_port=port, policy=policy, host_port=host_port, timings=timings)
            self._sbx[sid] = sb
            self.last_timings = timings
            return sb.placement()
        except BaseException:
            await self._unprovision(sid, vm)
            raise

    async def _provision(self, sid: str, layers: list[str], policy: NetworkPolicy
                         ) -> tuple[TapNet | UserNet, str, int, int | None]:
        """The network and the disk stack (`sbx-<sid>`) of a VM about to start; nothing is
        left if this fails. `_unprovision` undoes it (and kills the VM) if the start fails."""
        _net, vnet, host, port, host_port = await self._make_net(sid, policy)
        try:
            with contextlib.suppress(StackNotFoundError):
                await self.block.client.delete(f"sbx-{sid}")
            await self.block.client.create(f"sbx-{sid}", layers)
        except BaseException:
            await self._drop_net(sid)
            raise
        return vnet, host, port, host_port

    async def _unprovision(self, sid: str, vm: QemuProcess | None) -> None:
        if vm is not None:
            await self._release_vm(vm)
        with contextlib.suppress(Exception):
            await self._drop_stack(f"sbx-{sid}")
        await self._drop_net(sid)

    async def _boot(self, sid: str, snapshot_id: str, m: dict[str, Any],
                    network: NetworkConfig) -> Placement:
        """Cold-boot a new VM on the snapshot's disk layers (filesystem-only resume), its RAM
        in a share=on file in the VM's work dir so later snapshots can freeze a base."""
        t0 = time.perf_counter()
        policy = _policy(network)
        stack = f"sbx-{sid}"
        vm: QemuProcess | None = None
        timings: dict[str, float] = {}
        vnet, host, port, host_port = await self._provision(sid, m["disk"]["layers"], policy)
        try:
            scratch = self.config.vms_dir / sid / "ram.mem"
            spec = self._spec(m, name=sid, memory=MemoryBacking(path=scratch, shared=True),
                              stack=stack, network=vnet)
            timings["prepare_s"] = time.perf_counter() - t0
            vm = await self._spawn(spec, sid, incoming=False)
            timings["qmp_ready_s"] = vm.qmp_ready_s or 0.0
            timings["cold_boot_s"] = await vm.wait_for_envd(f"http://{host}:{port}",
                                                            self.config.boot_timeout_s)
            timings["total_s"] = time.perf_counter() - t0
            sb = _Sandbox(sandbox_id=sid, vm=vm, mode=self.mode, stack=stack, boot=_boot(m),
                          snapshot_id=snapshot_id, base_dir=None, memsnap_dir=None,
                          config_sha256=self._digest(spec), machine=MachineSpec(**m["machine"]),
                          envd_host=host, envd_port=port, policy=policy, host_port=host_port,
                          timings=timings, scratch=scratch)
            self._sbx[sid] = sb
            self.last_timings = timings
            return sb.placement()
        except BaseException:
            await self._unprovision(sid, vm)
            raise

    # -- snapshot (pause / fork) ------------------------------------------------------

    async def snapshot(self, sandbox_id: str, snapshot_id: str, *, stop: bool,
                       memory: bool = True) -> SnapshotRef:
        """Snapshot a running sandbox: memory + disk, or (`memory=False`, only with
        `stop=True`) its disk alone: a filesystem-only pause, resumed by a cold boot."""
        self._check_open()
        sb = self._get(sandbox_id)
        async with sb.lock:
            if self._sbx.get(sandbox_id) is not sb:
                raise SandboxNotFoundError(f"sandbox {sandbox_id} went away")
            self._writing.add(snapshot_id)
            try:
                ref = await self._snapshot(sb, snapshot_id, stop=stop, memory=memory)
            finally:
                self._writing.discard(snapshot_id)
        await self._trim_memory_cache()
        return ref

    async def _snapshot(self, sb: _Sandbox, snapshot_id: str, *, stop: bool,
                        memory: bool) -> SnapshotRef:
        t0 = time.perf_counter()
        root = self.config.memory_dir / snapshot_id
        with contextlib.suppress(SnapshotNotFoundError):
            await self.manifests.get(snapshot_id)
            raise NodeRuntimeError(f"snapshot {snapshot_id} already exists")
        if not memory and not stop:
            raise NodeRuntimeError("a filesystem-only snapshot stops the sandbox (stop=True)")
        if root.exists():  # leftovers of an uncommitted attempt
            shutil.rmtree(root)
        vm = sb.vm
        assert vm.qmp is not None
        timings: dict[str, float] = {}
        sealed: list[str] = []

        # Memory and disk are cut at the same instant: the disk upper is sealed while the
        # guest is stopped for the memory capture. A snapshot that keeps the sandbox running
        # resumes it right after; the diff is written, the new layer pushed and the memory
        # uploaded while the guest runs.
        async def seal() -> None:
            t = time.perf_counter()
            sealed.append(await self.block.client.seal(sb.stack, upload=False))
            timings["seal_s"] = time.perf_counter() - t

        paused = True  # until proven running: a failure below tries `cont`
        try:
            t_stop = time.perf_counter()
            if not memory:
                await vm.execute("stop")
                await seal()
                mem, new_memsnap, new_base = None, None, sb.base_dir
            elif sb.scratch is not None:
                mem, new_base = await self._freeze_snapshot(sb, root, seal, timings)
                new_memsnap = None
                if not stop:
                    await vm.execute("cont")
                    timings["downtime_s"] = time.perf_counter() - t_stop
            else:
                mem, new_memsnap = await self._incremental_snapshot(sb, root, seal, stop,
                                                                    timings)
                new_base = sb.base_dir
            paused = stop
            t_mem = time.perf_counter()
            timings["memory_s"] = t_mem - t_stop
            await self.block.client.push(sealed[0])
            info = await self.block.client.info(sb.stack)
            timings["push_s"] = time.perf_counter() - t_mem
            if mem is not None:
                t_up = time.perf_counter()
                own = await self._upload_memory(root)
                timings["upload_memory_s"] = time.perf_counter() - t_up
                mem["files"] = sorted({*mem["files"], *own})
            depends = {o for o in (self._owner(self._mem(f)) for f in
                                   (mem or {}).get("files", ())) if o} | {snapshot_id}
            boot = sb.boot or _boot(await self.manifests.get(sb.snapshot_id))  # old facts
            m: dict[str, Any] = {
                "version": VERSION, "kind": "snapshot" if mem else "disk",
                "snapshot_id": snapshot_id,
                "created_at": time.time(), "parent_id": sb.snapshot_id,
                "sandbox_id": sb.sandbox_id, "machine": dataclasses.asdict(sb.machine),
                "network_mode": sb.mode, **boot, "config_sha256": sb.config_sha256,
                "memory": mem,
                "disk": {"layers": list(info.layers), "virtual_size": info.virtual_size},
                "depends_on": sorted(depends),
            }
            timings["total_s"] = time.perf_counter() - t0
            m["timings"] = {k: round(v, 4) for k, v in timings.items()}
            await self.manifests.put(snapshot_id, m)  # the commit point
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            dead = not vm.alive()
            if not dead and paused:
                try:
                    await vm.execute("cont", timeout_s=5.0)
                except Exception:  # noqa: BLE001 - QMP gone: the sandbox is unusable
                    dead = True
            if dead:
                log.warning("sandbox %s: QEMU died during snapshot: releasing it", sb.sandbox_id)
                await self._release(sb)
            raise
        self.last_timings = timings
        if stop:
            await self._release(sb)
        else:
            sb.base_dir, sb.memsnap_dir = new_base, new_memsnap
            sb.snapshot_id = snapshot_id
        return SnapshotRef(snapshot_id, sb.machine, m["created_at"], m["parent_id"], m)

    async def _incremental_snapshot(
            self, sb: _Sandbox, root: Path, seal: Callable[[], Awaitable[None]], stop: bool,
            timings: dict[str, float]) -> tuple[dict[str, Any], Path]:
        """Memory diff against the restored chain (the VM maps its base privately)."""
        assert sb.vm.qmp is not None and sb.base_dir is not None
        base = await asyncio.to_thread(BaseImage.load, sb.base_dir)
        parent = (await asyncio.to_thread(MemSnapshot.load, sb.memsnap_dir)
                  if sb.memsnap_dir is not None else None)
        snap = await snapshot_incremental(
            sb.vm.qmp, sb.vm.pid, base.mem_path, base, root / "mem",
            config_sha256=bytes.fromhex(sb.config_sha256), parent=parent,
            max_chain=self.config.max_chain, resume=not stop, while_stopped=seal)
        timings.update({"downtime_s": snap.stats.get("downtime_ms", 0.0) / 1e3,
                        "diff_pages": float(snap.stats.get("diff_pages", 0)),
                        "chain_len": float(snap.stats.get("chain_len", 0))})
        base_files = [self._rel(f) for f in base.dir.iterdir() if f.is_file()]
        return ({"base_dir": self._rel(base.dir), "base_id": base.id,
                 "snapshot_dir": self._rel(snap.dir), "devstate": self._rel(snap.devstate),
                 "diffs": [self._rel(d) for d in snap.diffs],
                 "files": [*base_files, *(self._rel(d) for d in snap.diffs)]}, snap.dir)

    async def _freeze_snapshot(
            self, sb: _Sandbox, root: Path, seal: Callable[[], Awaitable[None]],
            timings: dict[str, float]) -> tuple[dict[str, Any], Path]:
        """A cold-booted VM (RAM in a share=on file) has no base to diff against: freeze a
        new one from its RAM (a full copy, like a template build). Leaves it stopped."""
        assert sb.vm.qmp is not None and sb.scratch is not None
        t = time.perf_counter()
        base = await freeze_base(sb.vm.qmp, sb.scratch, root / "base")
        timings["freeze_s"] = time.perf_counter() - t
        await seal()
        return ({"base_dir": self._rel(base.dir), "base_id": base.id, "snapshot_dir": None,
                 "devstate": self._rel(base.template_path), "files": []}, base.dir)

    # -- teardown ---------------------------------------------------------------------

    async def _release(self, sb: _Sandbox) -> None:
        self._sbx.pop(sb.sandbox_id, None)
        await self._release_vm(sb.vm)
        await self._drop_net(sb.sandbox_id)
        with contextlib.suppress(StorageError):
            await self._drop_stack(sb.stack)

    def exited(self) -> list[str]:
        return [sid for sid, sb in self._sbx.items()
                if not sb.lock.locked() and not sb.vm.alive()]

    async def kill(self, sandbox_id: str) -> None:
        sb = self._sbx.get(sandbox_id)
        if sb is None:
            await self._release_leftovers(sandbox_id, None)
            return
        async with sb.lock:
            if self._sbx.get(sandbox_id) is sb:
                await self._release(sb)

    async def _release_leftovers(self, sid: str, facts: dict[str, Any] | None) -> None:
        work = self.config.vms_dir / sid
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = int((work / "pid").read_text())
        if pid is None and facts and facts.get("pid"):
            pid = int(facts["pid"])
        pids = set()
        if pid is not None and is_our_qemu(pid, QemuRunFiles.in_dir(work).qmp_socket):
            pids.add(pid)
        scanned = await asyncio.to_thread(qemu_pids_under, self.config.vms_dir)
        pids |= {p for p, s in scanned.items() if s == sid}
        for p in pids:
            await QemuProcess(name=sid, work_dir=work, pid=p, proc=None, argv=[]).kill()
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(StorageError):
            await self._drop_stack(f"sbx-{sid}")
        if self.mode == "netns" and self.nm is not None:
            with contextlib.suppress(NetworkError, ValueError):
                await self.nm.destroy(sid)

    # -- adoption ---------------------------------------------------------------------

    async def adopt(self, sandbox_id: str, facts: dict[str, Any]) -> Placement | None:
        self._check_open()
        if sandbox_id in self._sbx:
            return self._sbx[sandbox_id].placement()
        work = Path(facts.get("work_dir") or self.config.vms_dir / sandbox_id)
        vm = None
        if facts.get("pid") and facts.get("mode") == self.mode:
            vm = await QemuProcess.adopt(name=sandbox_id, pid=int(facts["pid"]), work_dir=work)
        if vm is None:
            await self._release_leftovers(sandbox_id, facts)
            return None
        try:
            await self.block.client.info(str(facts["stack"]))
            pol = facts.get("policy") or {}
            sb = _Sandbox(
                sandbox_id=sandbox_id, vm=vm, mode=str(facts["mode"]), stack=str(facts["stack"]),
                snapshot_id=str(facts["snapshot_id"]),
                base_dir=Path(facts["base_dir"]) if facts.get("base_dir") else None,
                scratch=Path(facts["scratch"]) if facts.get("scratch") else None,
                boot=dict(facts.get("boot") or {}),
                memsnap_dir=Path(facts["memsnap_dir"]) if facts.get("memsnap_dir") else None,
                config_sha256=str(facts["config_sha256"]),
                machine=MachineSpec(**facts["machine"]), envd_host=str(facts["envd_host"]),
                envd_port=int(facts["envd_port"]),
                policy=NetworkPolicy(allow_internet_access=pol.get("allow_internet_access", True),
                                     allow_out=tuple(pol.get("allow_out", ())),
                                     deny_out=tuple(pol.get("deny_out", ()))),
                host_port=(int(facts["port_forwards"][str(ENVD_PORT)])
                           if facts.get("port_forwards") else None))
        except (KeyError, TypeError, ValueError, StorageError) as exc:
            log.warning("cannot adopt %s (%s): releasing it", sandbox_id, exc)
            await vm.kill()
            await self._release_leftovers(sandbox_id, facts)
            return None
        self._sbx[sandbox_id] = sb
        return sb.placement()

    async def _adopt_networks(self) -> None:
        """Hand adopted sandboxes' namespaces to the NetworkManager (removing other
        leftovers with our prefix that no live sandbox owns)."""
        if self.nm is None:
            return
        keep = {sid: sb.policy for sid, sb in self._sbx.items()
                if sid not in self.nm.networks}
        await self.nm.recover(keep)

    async def reap_orphans(self, known: set[str]) -> list[str]:
        self._check_open()
        reaped: set[str] = set()
        live = set(self._sbx) | self._busy
        for sid in list(self._sbx):
            if sid not in known:
                await self.kill(sid)
                reaped.add(sid)
        live = set(self._sbx) | self._busy
        building = {f"tpl-{t}" for t in self._building}
        stale = {d.name for d in self.config.vms_dir.iterdir()} if self.config.vms_dir.is_dir() \
            else set()
        stale |= set((await asyncio.to_thread(qemu_pids_under, self.config.vms_dir)).values())
        for sid in sorted(stale - live - building):
            await self._release_leftovers(sid, None)
            reaped.add(sid)
        for info in await self.block.client.list():
            if info.name.startswith("sbx-") and info.name[4:] not in live:
                await self._drop_stack(info.name)
                reaped.add(info.name[4:])
            elif info.name.startswith("tpl-") and info.name not in building:
                await self._drop_stack(info.name)
        if self.nm is not None:
            before = {ex.sandbox_id for ex in await self.nm.list_existing() if ex.sandbox_id}
            await self._adopt_networks()
            reaped |= {s for s in before if s not in live and not s.startswith("tpl-")}
        return sorted(reaped)

    # -- misc ---------------------------------------------------------------------------

    async def update_network(self, sandbox_id: str, network: NetworkConfig) -> None:
        sb = self._get(sandbox_id)
        policy = _policy(network)
        if sb.mode == "netns" and self.nm is not None:
            if sandbox_id not in self.nm.networks:
                await self._adopt_networks()
            await self.nm.update_policy(sandbox_id, policy)
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
        """Remove the manifest, then every memory dir (local and in the repository) no
        manifest or live sandbox uses. Disk layers stay in the repository (no layer GC in
        host/storage yet)."""
        gone: set[str] = {snapshot_id}
        with contextlib.suppress(SnapshotNotFoundError):
            gone |= set((await self.manifests.get(snapshot_id)).get("depends_on", ()))
        await self.manifests.delete(snapshot_id)
        used = await self._gc_memory()
        for owner in sorted(gone - used):
            try:
                await asyncio.to_thread(self.manifests.repo.delete_files, MEMORY_KEY + owner)
            except (RepositoryError, OSError) as exc:
                log.warning("removing memory of %s from the repository: %s", owner, exc)

    def _pinned_memory(self) -> set[str]:
        """Memory dirs this node needs locally now: live sandboxes' bases and diff chains,
        templates being built, snapshots being written, files being fetched."""
        pinned: set[str] = set(self._building) | set(self._writing)
        pinned |= {name.split("/", 1)[0] for name in self._fetching}
        for sb in self._sbx.values():
            for p in (sb.base_dir, sb.memsnap_dir):
                if p is not None and (o := self._owner(p)):
                    pinned.add(o)
            if sb.memsnap_dir is not None:
                with contextlib.suppress(MemSnapError):
                    snap = MemSnapshot.load(sb.memsnap_dir)
                    pinned |= {o for o in (self._owner(d) for d in snap.diffs) if o}
        return pinned

    async def _gc_memory(self) -> set[str]:
        """Remove local memory dirs nothing uses; returns the snapshot ids still used."""
        manifests = await self.manifests.all()
        used: set[str] = set(manifests) | self._pinned_memory()
        for m in manifests.values():
            used |= set(m.get("depends_on", ()))
        if self.config.memory_dir.is_dir():
            for d in self.config.memory_dir.iterdir():
                if d.name not in used:
                    await asyncio.to_thread(shutil.rmtree, d, True)
        return used

    async def _trim_memory_cache(self) -> None:
        """With a remote repository `memory/` is a bounded cache: evict the least recently
        used memory dirs no live sandbox needs (their files are in the repository: only
        committed snapshots are evicted) until it fits `memory_cache_mib`. A posix_fs
        repository shares the bytes (hard links), so evicting would free nothing. Runs
        after every start and snapshot: the repository is asked only when over the bound."""
        if isinstance(self.manifests.repo, PosixFsRepository) or not self.config.memory_dir.is_dir():
            return

        def sizes() -> list[tuple[float, Path, int]]:
            return sorted((d.stat().st_mtime, d,
                           sum(f.stat().st_blocks * 512 for f in d.rglob("*") if f.is_file()))
                          for d in self.config.memory_dir.iterdir())

        dirs = await asyncio.to_thread(sizes)
        total = sum(size for _, _, size in dirs)
        bound = self.config.memory_cache_mib << 20
        pinned = self._pinned_memory()
        evicted = []
        for _, d, size in dirs:  # least recently used first
            if total <= bound:
                break
            if d.name in pinned or await self.find_snapshot(d.name) is None:
                continue
            await asyncio.to_thread(shutil.rmtree, d, True)
            total -= size
            evicted.append(d.name)
        if evicted:
            log.info("memory cache over %d MiB: evicted %s", self.config.memory_cache_mib,
                     ", ".join(evicted))

    async def console_log(self, sandbox_id: str, limit: int = 1000) -> list[str]:
        sb = self._get(sandbox_id)
        text = await asyncio.to_thread(tail, sb.vm.serial_log, limit, 4 * 1024 * 1024)
        return text.splitlines()
