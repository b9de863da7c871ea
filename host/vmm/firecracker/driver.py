"""The Firecracker driver: one `FirecrackerVm` per `firecracker` process, controlled over
its REST API on a unix socket.

A `FirecrackerVm` (vm.py) owns the process (its own session; started through `jailer` when one
is configured), the API socket, the serial log (the process's stdout: Firecracker writes
the guest's ttyS0 there), its stderr and log file, the kernel block devices its NbdDisks
are attached as (blockdev.py), the chroot if jailed (jailer.py) and the work dir;
`kill()` leaves none of them behind.

Boot: PUT /machine-config, /boot-source, /drives/{id}, /network-interfaces/{id},
optionally /balloon, then PUT /actions InstanceStart (bodies: config.py).
Pause/resume: PATCH /vm. Memory snapshots in memsnap's form (freeze_memory,
snapshot_memory, restore_memory: snapshots.py). The older whole-VM pair:
`save_state(dest)` writes the device state to `dest` and guest memory to
`snapshot_mem_path(dest)`; `restore()` loads both into a fresh process.

What Firecracker cannot do, and the driver rejects with a VmmError saying so:
user-mode networking (TAP only), qcow2 images, booting without a kernel.

NOT VERIFIED AGAINST A REAL FIRECRACKER: the development host has no Firecracker binary
and only a paravirtual (PVM) KVM, which Firecracker cannot use. The tests run this driver
against a fake API server that validates each request against Firecracker's published
OpenAPI document (v1.16.1, tests/vmm/data/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc as procs
from ..driver import BootTimeouts, VmSpec
from ..errors import VmmError
from ..identity import VmmIdentity, host_cpu_model
from ..jail import JailConfig, UidPool
from ..vmbase import DriverBase, default_run_dir
from .blockdev import NbdAttacher
from .config import (
    DEFAULT_FIRECRACKER,
    BalloonConfig,
    config_digest,
    firecracker_usable,
    firecracker_version,
)
from .jailer import JailerConfig, release_jail
from .leftovers import belongs_to, find_leftovers, recorded_devices
from .snapshots import snapshot_mem_path
from .vm import FirecrackerVm

if TYPE_CHECKING:
    from ..memsnap import BaseImage, MemSnapshot

__all__ = ["BalloonConfig", "FirecrackerDriver", "FirecrackerVm", "firecracker_usable",
           "snapshot_mem_path"]


class FirecrackerDriver(DriverBase["FirecrackerVm"]):
    """Starts Firecracker microVMs (KVM only; see `firecracker_usable`)."""

    name = "firecracker"

    def __init__(
        self,
        *,
        firecracker: str = DEFAULT_FIRECRACKER,
        run_dir: Path | None = None,
        die_with_parent: bool = True,
        balloon: BalloonConfig | None = None,
        track_dirty_pages: bool = True,
        jailer: JailerConfig | None = None,
        block: NbdAttacher | None = None,
        jail: JailConfig | None = None,
    ) -> None:
        super().__init__(run_dir=run_dir or default_run_dir(), die_with_parent=die_with_parent)
        self.firecracker = firecracker
        self.balloon = balloon
        # KVM dirty-page logging: snapshot_memory needs it (Diff snapshots of exactly the
        # pages written since the last snapshot or load); it costs some guest CPU.
        self.track_dirty_pages = track_dirty_pages
        self.jailer = jailer
        self.block = block or NbdAttacher()
        # each jailed VM its own uid/gid from the VM jail's range (--vm-uid-range), unless
        # --jailer-uid names one for all
        self.uids = (UidPool(*jail.uid_range) if jail is not None and jail.enabled
                     and jailer is not None and jailer.uid == 0 else None)

    def jailer_for_vm(self) -> JailerConfig | None:
        """The jailer settings of one new VM: its own uid and gid where the pool hands
        them out; release them with `release_uid` once its process is gone."""
        if self.jailer is None or self.uids is None:
            return self.jailer
        uid = self.uids.allocate()
        return dataclasses.replace(self.jailer, uid=uid, gid=uid)

    def release_uid(self, uid: int) -> None:
        if self.uids is not None and uid != 0:
            self.uids.release(uid)

    def _new_vm(self, spec: VmSpec, timeouts: BootTimeouts | None) -> FirecrackerVm:
        return FirecrackerVm(self, spec, timeouts or BootTimeouts())

    async def restore(
        self, spec: VmSpec, state: Path, *, timeouts: BootTimeouts | None = None,
        resume: bool = True,
    ) -> FirecrackerVm:
        """Guest memory comes from `spec.memory.path` (must be shared=False: Firecracker
        maps it copy-on-write) or else from `snapshot_mem_path(state)`."""
        vm = self._new_vm(spec, timeouts)
        await vm._start(state_file=Path(state), resume=resume)
        return vm

    def config_digest(self, spec: VmSpec) -> str:
        return config_digest(spec, version=firecracker_version(self.firecracker),
                             balloon=self.balloon)

    def identity(self) -> VmmIdentity:
        # KVM only, and no CPU template is set: the guest sees the host's CPU
        return VmmIdentity(vmm="firecracker", version=firecracker_version(self.firecracker),
                           accel="kvm", cpu="host", host_cpu=host_cpu_model())

    async def restore_memory(
        self, spec: VmSpec, *, base: BaseImage, snapshot: MemSnapshot | None = None,
        timeouts: BootTimeouts | None = None, resume: bool = True,
    ) -> FirecrackerVm:
        vm = self._new_vm(spec, timeouts)
        await vm._start(state_file=None, resume=resume, memory=(base, snapshot))
        return vm

    def leftovers(self, run_dir: Path) -> dict[int, str]:
        return find_leftovers(run_dir)

    async def kill_pid(self, pid: int, work_dir: Path) -> None:
        if belongs_to(pid, work_dir):
            started = procs.start_time(pid)
            if started is not None:
                gone = await procs.terminate(procs.AdoptedProcess(pid, started), grace_s=2.0)
                if not gone:
                    raise VmmError(f"Firecracker pid {pid} survived SIGKILL")
        await self.discard(work_dir)

    async def discard(self, work_dir: Path) -> None:
        await release_jail(work_dir)
        for dev in recorded_devices(work_dir):
            await self.block.detach(dev)
        await asyncio.to_thread(shutil.rmtree, work_dir, True)
