"""`Machines`: a node's VMs and what each one is attached to, through the VMM driver.

Owns the driver (QEMU or Firecracker, see `host.vmm.pick_driver`), the network manager
(namespaces, or user-mode networking where they cannot be made) and the block server's
stacks as VMs use them. Everything here is per VM: a network plus a disk stack are
provisioned together and released together (`provision` / `unprovision`), and a VM is
started, restored, adopted and killed only through the driver. Nothing else in the
runtime starts a VMM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from host.hostmem import KsmSwitch
from host.network import (
    NetworkError,
    NetworkManager,
    NetworkManagerConfig,
    NetworkPolicy,
    NetworkUnavailableError,
    SandboxNetwork,
)
from host.network.sandbox import TAP_NAME
from host.storage.errors import StackNotFoundError
from host.vmm import pick_driver, procscan
from host.vmm import proc as procs
from host.vmm.driver import (
    ENVD_PORT,
    MemoryBacking,
    NbdDisk,
    TapNet,
    UserNet,
    Vm,
    VmmDriver,
    VmSpec,
)
from host.vmm.errors import VmmError, VmmSnapshotError
from host.vmm.identity import VmmIdentity
from host.vmm.memsnap import BaseImage, MemSnapshot
from host.vmm.proc import free_port

from .blockd import BlockServerHandle
from .config import RuntimeConfig
from .errors import NodeRuntimeError, SandboxStartError, SnapshotCorruptError

log = logging.getLogger(__name__)

Attach = tuple[TapNet | UserNet, str, int, int | None]  # vm network, envd host, port, fwd


def make_driver(cfg: RuntimeConfig) -> VmmDriver:
    """The configured driver (`cfg.vmm`: auto | qemu | firecracker; $AENV_VMM for auto)."""
    # pick_driver drops the options the chosen driver does not take
    kw: dict[str, Any] = {"run_dir": cfg.vms_dir, "die_with_parent": not cfg.vms_survive_service,
                          "qemu": cfg.qemu, "firecracker": cfg.firecracker,
                          "jailer": cfg.jailer, "jailer_uid": cfg.jailer_uid,
                          "jailer_gid": cfg.jailer_gid, "ksm": cfg.ksm, "jail": cfg.jail,
                          "log_dir": cfg.vm_logs_dir, "tcg_tb_mib": cfg.tcg_tb_mib}
    try:
        return pick_driver(None if cfg.vmm == "auto" else cfg.vmm, **kw)
    except VmmError as exc:
        raise NodeRuntimeError(str(exc)) from exc


class Machines:
    def __init__(self, config: RuntimeConfig, block: BlockServerHandle) -> None:
        self.config = config
        self.block = block
        self.driver: VmmDriver | None = None
        self.nm: NetworkManager | None = None
        self.mode = "user"
        self.ksm = KsmSwitch()

    async def open(self) -> None:
        cfg = self.config
        self.driver = make_driver(cfg)
        if cfg.ksm:
            log.info("%s", await asyncio.to_thread(self.ksm.enable))
        if cfg.network in ("auto", "netns"):
            nm = NetworkManager(NetworkManagerConfig(pool=cfg.network_pool,
                                                     prefix=cfg.network_prefix))
            try:
                await nm.open()
                self.nm, self.mode = nm, "netns"
            except NetworkUnavailableError as exc:
                if cfg.network == "netns":
                    raise NodeRuntimeError(f"network namespaces unavailable: {exc}") from exc
                log.warning("network namespaces unavailable (%s): user-mode networking, "
                            "in which sandboxes have no outbound network (slirp cannot keep "
                            "them off this host's loopback services)", exc)
        if self.mode != "netns" and self.driver.name == "firecracker":
            raise NodeRuntimeError("Firecracker needs network namespaces (it has no "
                                   "user-mode networking): run as root with nftables")
        log.info("VMM driver: %s; networking: %s", self.driver.name, self.mode)

    async def close(self, *, keep_networks: bool) -> None:
        """Put ksmd back as `open` found it; close the network manager (its networks stay
        with `keep_networks`, for VMs a later service adopts)."""
        await asyncio.to_thread(self.ksm.restore)
        if self.nm is not None:
            with contextlib.suppress(NetworkError):
                await self.nm.aclose(keep_networks=keep_networks)
            self.nm = None

    @property
    def vmm(self) -> VmmDriver:
        if self.driver is None:
            raise NodeRuntimeError("NodeRuntime is not open")
        return self.driver

    # -- VM specs -----------------------------------------------------------------------

    def spec(self, m: dict[str, Any], *, name: str, memory: MemoryBacking | None, stack: str,
             network: TapNet | UserNet | None, extra_stacks: tuple[str, ...] = ()) -> VmSpec:
        """The VM of manifest-like `m` (kernel, cmdline, machine): its root disk is
        `stack`, then one disk per `extra_stacks` (/dev/vdb, ...)."""
        machine = m["machine"]
        disks = tuple(NbdDisk(socket=self.block.export_socket(s), export=s)
                      for s in (stack, *extra_stacks))
        return VmSpec(kernel=Path(m["kernel"]), cmdline=m["cmdline"],
                      vcpus=int(machine["cpu_count"]), mem_mib=int(machine["memory_mb"]),
                      disks=disks, network=network, memory=memory, name=name,
                      work_dir=self.config.vms_dir / name, balloon=self.config.balloon)

    def digest(self, spec: VmSpec) -> str:
        return self.vmm.config_digest(spec)

    def restore_digest(self, m: dict[str, Any]) -> str:
        """The digest a restore of manifest `m` on this node computes (starts.py compares
        it with `m["config_sha256"]`): a spec on the network every sandbox here shares as
        far as a digest sees (the TAP's name and MAC; slirp's forward is normalised)."""
        network: TapNet | UserNet = UserNet(host_port=0)
        if self.mode == "netns" and self.nm is not None:
            network = TapNet(tap=TAP_NAME, guest_ip="", mac=self.nm.config.guest.mac)
        return self.digest(self.spec(m, name="digest", stack="digest", network=network,
                                     memory=MemoryBacking(path=Path("/MEM"), shared=False)))

    def guest_net_cmdline(self) -> str:
        """The network part of every VM's kernel command line here (a namespace's guest
        side is the same in all: `SandboxNetwork.kernel_cmdline`)."""
        if self.mode == "netns" and self.nm is not None:
            return self.nm.config.guest.cmdline_args()
        return ""

    async def identity(self) -> VmmIdentity:
        """What memory snapshots taken here record and restores here must match."""
        try:
            return await asyncio.to_thread(self.vmm.identity)  # runs `--version` once
        except VmmError as exc:
            raise SandboxStartError(str(exc)) from exc

    # -- per-VM network and disk ----------------------------------------------------------

    async def make_net(self, sid: str, policy: NetworkPolicy
                       ) -> tuple[SandboxNetwork | None, Attach]:
        if self.mode == "netns":
            assert self.nm is not None
            net = await self.nm.create(sid, policy)
            tap = TapNet(tap=net.tap, guest_ip=net.address, netns=net.netns, mac=net.guest.mac)
            return net, (tap, net.address, ENVD_PORT, None)
        port = free_port()
        return None, (UserNet(host_port=port), "127.0.0.1", port, port)

    async def drop_net(self, sid: str) -> None:
        if self.mode == "netns" and self.nm is not None:
            try:
                await self.nm.destroy(sid)
            except NetworkError as exc:
                log.warning("destroying network of %s: %s", sid, exc)

    async def drop_stack(self, name: str) -> None:
        with contextlib.suppress(StackNotFoundError):
            await self.block.client.delete(name)

    async def provision(self, sid: str, layers: list[str], policy: NetworkPolicy) -> Attach:
        """The network and the disk stack (`sbx-<sid>`) of a VM about to start; nothing is
        left if this fails. `unprovision` undoes it (and kills the VM)."""
        _net, attach = await self.make_net(sid, policy)
        try:
            await self.drop_stack(f"sbx-{sid}")
            await self.block.client.create(f"sbx-{sid}", layers)
        except BaseException:
            await self.drop_net(sid)
            raise
        return attach

    async def unprovision(self, sid: str, vm: Vm | None) -> None:
        if vm is not None:
            await self.release_vm(vm)
        with contextlib.suppress(Exception):
            await self.drop_stack(f"sbx-{sid}")
        await self.drop_net(sid)

    # -- VMs ------------------------------------------------------------------------------

    def _fresh_work_dir(self, spec: VmSpec) -> None:
        assert spec.work_dir is not None
        if spec.work_dir.exists():  # a leftover of an earlier VM of that name
            shutil.rmtree(spec.work_dir, ignore_errors=True)

    async def boot(self, spec: VmSpec, *, timeout_s: float) -> tuple[Vm, dict[str, float]]:
        """Cold-boot `spec` and wait for envd; killed on any failure."""
        self._fresh_work_dir(spec)
        t0 = time.perf_counter()
        vm = await self._start(self.vmm.start(spec))
        try:
            await self._envd(vm, timeout_s)
        except BaseException:
            await self.release_vm(vm)
            raise
        return vm, {**vm.start_timings, "cold_boot_s": time.perf_counter() - t0}

    async def restore(self, spec: VmSpec, base: BaseImage, snap: MemSnapshot | None, *,
                      timeout_s: float, what: str) -> tuple[Vm, dict[str, float]]:
        """Restore `base` (+ `snap`'s chain) and wait for envd; killed on any failure."""
        self._fresh_work_dir(spec)
        t0 = time.perf_counter()
        try:
            vm = await self._start(self.vmm.restore_memory(spec, base=base, snapshot=snap))
        except VmmSnapshotError as exc:
            raise SnapshotCorruptError(f"restore of snapshot {what} failed: {exc}") from exc
        t1 = time.perf_counter()
        try:
            if spec.balloon:
                # a snapshot taken while the pressure guard had the guest's balloon
                # inflated would keep it: a resumed sandbox is an active one
                await vm.set_balloon(0)
            envd_s = await self._envd(vm, timeout_s)
        except VmmError as exc:
            await self.release_vm(vm)
            raise SandboxStartError(str(exc)) from exc
        except BaseException:
            await self.release_vm(vm)
            raise
        return vm, {**vm.start_timings, "vmm_start_s": t1 - t0, "envd_s": envd_s}

    @staticmethod
    async def _start(start: Any) -> Vm:
        try:
            vm: Vm = await start
        except VmmSnapshotError:
            raise
        except VmmError as exc:
            raise SandboxStartError(str(exc)) from exc
        return vm

    @staticmethod
    async def _envd(vm: Vm, timeout_s: float) -> float:
        try:
            return await vm.wait_for_envd(timeout_s)
        except VmmError as exc:
            raise SandboxStartError(str(exc)) from exc

    async def release_vm(self, vm: Vm) -> None:
        """Kill the VM; its work dir goes with it."""
        try:
            await vm.kill()
        except VmmError as exc:
            log.error("killing %s: %s", vm.spec.name, exc)
        if vm.spec.work_dir is not None:
            shutil.rmtree(vm.spec.work_dir, ignore_errors=True)

    async def adopt_vm(self, sid: str, facts: dict[str, Any]) -> Vm | None:
        """Re-attach to the VM a sandbox's facts describe (None: it is gone)."""
        vm_facts = facts.get("vm") or _legacy_vm_facts(facts)
        if not vm_facts or vm_facts.get("driver") != self.vmm.name:
            return None
        # A sandbox's VM always works in vms_dir/<sid>: facts naming another dir (another
        # sandbox's) must not make a failed adoption remove that dir.
        work = self.config.vms_dir / sid
        vm_facts = dict(vm_facts, work_dir=str(work))
        spec = VmSpec(kernel=None, network=None, name=sid, work_dir=work,
                      memory=_memory_of(facts))
        try:
            return await self.vmm.adopt(spec, vm_facts)
        except VmmError as exc:
            log.warning("cannot adopt the VM of %s: %s", sid, exc)
            return None

    async def release_leftovers(self, sid: str, facts: dict[str, Any] | None, *,
                                keep_stack: bool = False) -> None:
        """Kill whatever VMM process of `sid` is still around (recorded or found in
        /proc) and remove its work dir, stack (unless `keep_stack`) and network."""
        work = self.config.vms_dir / sid
        pids: set[int] = set()
        with contextlib.suppress(OSError, ValueError):
            pids.add(int((work / "pid").read_text()))
        if facts and facts.get("pid"):
            pids.add(int(facts["pid"]))
        pids |= {p for p, name in self.vmm.leftovers(self.config.vms_dir).items() if name == sid}
        for pid in pids:
            try:
                await self.vmm.kill_pid(pid, work)
            except VmmError as exc:
                log.error("leftover VM of %s: %s", sid, exc)
        # a VM that died on its own left no pid to kill but its jail's cgroup, its work dir
        # and its serial log (whose old owner a jailed VM of the same id could not reopen)
        await self.vmm.discard(work)
        if not keep_stack:
            await self.drop_stack(f"sbx-{sid}")
        if self.mode == "netns" and self.nm is not None:
            with contextlib.suppress(NetworkError, ValueError):
                await self.nm.destroy(sid)


def _memory_of(facts: dict[str, Any]) -> MemoryBacking | None:
    if facts.get("scratch"):
        return MemoryBacking(path=Path(facts["scratch"]), shared=True)
    if facts.get("base_dir"):
        return MemoryBacking(path=Path(facts["base_dir"]) / "base.mem", shared=False)
    return None


def _legacy_vm_facts(facts: dict[str, Any]) -> dict[str, Any] | None:
    """Facts persisted before VMs ran through the driver (pid, work_dir only)."""
    if not facts.get("pid") or not facts.get("work_dir"):
        return None
    pid, work = int(facts["pid"]), Path(facts["work_dir"])
    if not procscan.is_vmm_for(pid, "qemu-system", work / "qmp.sock"):
        return None
    fwd = facts.get("port_forwards") or {}
    return {"driver": "qemu", "name": work.name, "pid": pid,
            "pid_start": procs.start_time(pid), "work_dir": str(work), "owns_work_dir": True,
            "argv": procscan.pid_cmdline(pid), "host_port": fwd.get(str(ENVD_PORT)),
            "accel": None, "config_sha256": facts.get("config_sha256")}
