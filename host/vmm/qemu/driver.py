"""The QEMU driver: starts, restores and adopts `QemuVm`s (vm.py), one per QEMU process.

`QemuDriver` holds what its VMs share: the QEMU binary and its accelerator, the run dir,
the jail's uid pool, the private-RAM preload (preload.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from .. import proc as procs
from .. import procscan
from ..accel import DEFAULT_QEMU, detect_accel, host_tsc_khz
from ..driver import BootTimeouts, VmSpec
from ..errors import VmmError, VmmStartError
from ..identity import VmmIdentity, binary_version, host_cpu_model
from ..image import cache_dir
from ..jail import Jail, JailConfig, UidPool
from ..jail import forget as forget_jail
from ..vmbase import DriverBase, default_run_dir
from . import memory as qemu_memory
from .cmdline import TCG_TB_MIB, QemuRunFiles, config_digest, cpu_model
from .preload import private_ram_preload
from .vm import QemuVm

if TYPE_CHECKING:
    from ..memsnap import BaseImage, MemSnapshot

log = logging.getLogger(__name__)


class QemuDriver(DriverBase["QemuVm"]):
    """Starts QEMU microVMs. KVM when it runs standard guests, else TCG (see accel.py)."""

    name = "qemu"

    def __init__(
        self,
        *,
        qemu: str = DEFAULT_QEMU,
        accel: str | None = None,
        run_dir: Path | None = None,
        die_with_parent: bool = True,
        tcg_tb_mib: int | None = None,
        ksm: bool = False,
        jail: JailConfig | None = None,
        log_dir: Path | None = None,
    ) -> None:
        super().__init__(run_dir=run_dir or default_run_dir(), die_with_parent=die_with_parent)
        # serial logs: here (on disk) instead of the work dir (often tmpfs); the runtime
        # rotates them (proc.rotate_log), a jail's RLIMIT_FSIZE bounds each in between
        self.log_dir = log_dir
        self.qemu = qemu
        self.ksm = ksm  # VMs' memory may be merged by ksmd (`--ksm`)
        # every VM confined (host/vmm/jail) when given and enabled
        self.jail = jail if jail is not None and jail.enabled else None
        self.uids = UidPool(*self.jail.uid_range) if self.jail is not None else None
        self._accel = accel
        # the TCG code buffer per VM (0: QEMU's default, 1 GiB; the service's --tcg-tb-mib)
        self.tcg_tb_mib = TCG_TB_MIB if tcg_tb_mib is None else tcg_tb_mib

    async def accel(self) -> tuple[str, int | None]:
        """(accelerator, host TSC kHz); detection is blocking and cached, so run it off-loop."""
        name = self._accel or (await asyncio.to_thread(detect_accel, self.qemu)).name
        return name, await asyncio.to_thread(host_tsc_khz)

    def _new_vm(self, spec: VmSpec, timeouts: BootTimeouts | None) -> QemuVm:
        return QemuVm(self, spec, timeouts or BootTimeouts())

    def version(self) -> tuple[int, int]:
        """(major, minor) of the QEMU binary (cached per binary file)."""
        try:
            line = binary_version(self.qemu)
        except VmmError:
            return (0, 0)  # unknown: no feature of a newer QEMU is assumed
        m = re.search(r"version (\d+)\.(\d+)", line)
        return (int(m.group(1)), int(m.group(2))) if m else (0, 0)

    def readonly_private_ram(self) -> bool:
        """QEMU 8.2+ opens a share=off memory file read-only (`readonly=on,rom=off`); older
        releases open it read-write even when they map it copy-on-write."""
        return self.version() >= (8, 2)

    def private_ram_preload(self) -> Path | None:
        """The preload that makes a balloon's discards safe over a shared base (built once
        per source version; see preload.py); None without a C compiler."""
        # in the build cache, as the kernel: the run dir holds only its VMs' files
        return private_ram_preload(cache_dir() / "lib")

    def new_jail(self, name: str) -> Jail | None:
        if self.jail is None:
            return None
        assert self.uids is not None
        if not self.readonly_private_ram():
            major, minor = self.version()
            raise VmmStartError(
                f"{name}: the VM jail needs QEMU 8.2 or later ({self.qemu} is {major}.{minor}):"
                " an unprivileged QEMU cannot open a shared memory file read-write. Run"
                " `make setup` (QEMU 10 from bookworm-backports) or turn the jail off"
                " (--vm-jail off)")
        return Jail(self.jail, self.uids, name=name)

    async def restore(
        self, spec: VmSpec, state: Path, *, timeouts: BootTimeouts | None = None,
        resume: bool = True,
    ) -> QemuVm:
        vm = self._new_vm(spec, timeouts)
        await vm._start(state_file=Path(state), resume=resume)
        return vm

    def config_digest(self, spec: VmSpec) -> str:
        accel = self._accel or detect_accel(self.qemu).name  # cached after the first call
        return config_digest(spec, accel=accel, tsc_khz=host_tsc_khz(), qemu=self.qemu,
                             tcg_tb_mib=self.tcg_tb_mib)

    def identity(self) -> VmmIdentity:
        accel = self._accel or detect_accel(self.qemu).name  # cached after the first call
        cpu = cpu_model(accel)
        return VmmIdentity(vmm="qemu", version=binary_version(self.qemu), accel=accel,
                           cpu=cpu, host_cpu=host_cpu_model() if cpu == "host" else None)

    async def restore_memory(
        self, spec: VmSpec, *, base: BaseImage, snapshot: MemSnapshot | None = None,
        timeouts: BootTimeouts | None = None, resume: bool = True,
    ) -> QemuVm:
        vm = self._new_vm(spec, timeouts)
        qemu_memory.check_restore_spec(spec.name, spec.memory, base)
        await vm._start(state_file=None, resume=resume, memory=(base, snapshot))
        return vm

    def leftovers(self, run_dir: Path) -> dict[int, str]:
        return procscan.vmm_pids_under(run_dir, "qemu-system", "qmp.sock")

    async def kill_pid(self, pid: int, work_dir: Path) -> None:
        if procscan.is_vmm_for(pid, "qemu-system", QemuRunFiles.in_dir(work_dir).qmp_socket):
            started = procs.start_time(pid)
            if started is not None:
                gone = await procs.terminate(procs.AdoptedProcess(pid, started), grace_s=2.0)
                if not gone:
                    raise VmmError(f"QEMU pid {pid} survived SIGKILL")
        await self.discard(work_dir)

    async def discard(self, work_dir: Path) -> None:
        await asyncio.to_thread(forget_jail, work_dir)
        await asyncio.to_thread(shutil.rmtree, work_dir, True)
        if self.log_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.log_dir / work_dir.name, True)

    def leftover_names(self, run_dir: Path) -> set[str]:
        names = super().leftover_names(run_dir)
        if self.log_dir is not None and self.log_dir.is_dir():
            names |= {d.name for d in self.log_dir.iterdir()}
        return names


@contextlib.asynccontextmanager
async def booted(spec: VmSpec, *, driver: QemuDriver | None = None,
                 timeouts: BootTimeouts | None = None) -> AsyncIterator[QemuVm]:
    """`async with booted(spec) as vm:` a VM with envd ready; killed on exit."""
    drv = driver or QemuDriver()
    vm = await drv.boot(spec, timeouts=timeouts)
    async with vm:
        yield vm
