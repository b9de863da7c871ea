"""Kernel block devices for `NbdDisk`s: one job, attach an export of our userspace NBD
server as /dev/nbdN before a VM starts, detach it after the VM is gone.

Firecracker opens only files and block devices, while the storage layer serves each
sandbox's disk over NBD on a unix socket (QEMU connects to it directly). The kernel's
`nbd` module bridges the two: `nbd-client -unix SOCKET -N EXPORT /dev/nbdN` (Debian
package `nbd-client`) connects a free device and returns; `nbd-client -d /dev/nbdN`
disconnects it.

ublk (`ublk_drv`) would be the faster bridge, but it needs a ublk userspace server and
our block server has none: where `ublk_drv` is loaded we say so and use NBD. Where
neither `nbd` is loaded nor `modprobe nbd` works, `check()` raises a VmmError naming
both modules.

Linux-only; every path under /sys and /dev is a constructor argument, so the tests run
it against a fake sysfs and a fake `nbd-client` (the development host has no nbd module).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..driver import NbdDisk
from ..errors import VmmError
from ..proc import run_command

log = logging.getLogger(__name__)

DEFAULT_NBD_CLIENT = "nbd-client"
_READY_S = 10.0
_NBD_DEV = re.compile(r"^nbd(\d+)$")


@dataclass(frozen=True)
class KernelBlock:
    """Which kernel bridge attaches NbdDisks here, and why."""

    kind: str  # "nbd"
    note: str  # e.g. "ublk_drv present but no ublk server: using NBD"


class NbdAttacher:
    """Attaches NbdDisks as /dev/nbdN with `nbd-client`; remembers nothing across calls
    (the VM that attached a device records it and detaches it)."""

    def __init__(self, *, nbd_client: str = DEFAULT_NBD_CLIENT, modprobe: str = "modprobe",
                 sys_root: Path = Path("/sys"), dev_root: Path = Path("/dev"),
                 block_size: int = 4096) -> None:
        self.nbd_client = nbd_client
        self.modprobe = modprobe
        self.sys_root = sys_root
        self.dev_root = dev_root
        self.block_size = block_size
        self._checked: KernelBlock | None = None
        self._lock = asyncio.Lock()  # two VMs of this process never race for one device

    # -- detection --------------------------------------------------------------------

    def _module(self, name: str) -> bool:
        return (self.sys_root / "module" / name).exists()

    async def check(self) -> KernelBlock:
        """The bridge to use (cached once found); VmmError when there is none."""
        if self._checked is not None:
            return self._checked
        ublk = self._module("ublk_drv")
        tried = ""
        if not self._module("nbd"):
            rc, out = await run_command([self.modprobe, "nbd"])
            tried = f" (modprobe nbd: {out.strip() or f'exit {rc}'})" if rc else ""
        if not self._module("nbd"):
            have = "ublk_drv is loaded but our block server has no ublk server, and " \
                if ublk else "neither ublk_drv nor "
            raise VmmError(f"Firecracker needs NbdDisks as kernel block devices: {have}the "
                           f"nbd kernel module is available{tried}")
        if shutil.which(self.nbd_client) is None:
            raise VmmError(f"the nbd module is loaded but {self.nbd_client} is not installed "
                           "(Debian package nbd-client)")
        note = "ublk_drv present but no ublk server: using NBD" if ublk else "using NBD"
        if ublk:
            log.info(note)
        self._checked = KernelBlock("nbd", note)
        return self._checked

    # -- attach / detach ----------------------------------------------------------------

    def _devices(self) -> list[str]:
        names = []
        for p in (self.sys_root / "block").glob("nbd*"):
            if _NBD_DEV.match(p.name):
                names.append(p.name)
        return sorted(names, key=lambda n: int(n[3:]))

    def _free(self, name: str) -> bool:
        """No client connected: no pid file and size 0 (what the nbd driver shows)."""
        sysdir = self.sys_root / "block" / name
        if (sysdir / "pid").exists():
            return False
        try:
            return int((sysdir / "size").read_text().strip() or "0") == 0
        except (OSError, ValueError):
            return False

    def argv(self, disk: NbdDisk, device: Path) -> list[str]:
        """The nbd-client command line that connects `disk` to `device`."""
        argv = [self.nbd_client, "-unix", str(disk.socket), "-N", disk.export,
                "-b", str(self.block_size)]
        if disk.read_only:
            argv.append("-readonly")
        return [*argv, str(device)]

    async def attach(self, disk: NbdDisk) -> Path:
        """Connect `disk` to a free /dev/nbdN and return that device path."""
        await self.check()
        async with self._lock:
            errors = []
            for name in self._devices():
                if not self._free(name):
                    continue
                device = self.dev_root / name
                rc, out = await run_command(self.argv(disk, device))
                if rc == 0:
                    await self._wait_ready(name, disk)
                    log.debug("attached %s:%s as %s", disk.socket, disk.export, device)
                    return device
                # Another process may have taken it between our look and nbd-client.
                errors.append(f"{device}: {out.strip() or f'exit {rc}'}")
                if len(errors) >= 3:
                    break
            detail = "; ".join(errors) if errors else "no free /dev/nbdN (raise nbds_max)"
            raise VmmError(f"cannot attach NBD export {disk.export!r} at {disk.socket}: "
                           f"{detail}")

    async def _wait_ready(self, name: str, disk: NbdDisk) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _READY_S
        while self._free(name):
            if loop.time() > deadline:
                await self.detach(self.dev_root / name)
                raise VmmError(f"/dev/{name} did not come up for NBD export {disk.export!r}")
            await asyncio.sleep(0.01)

    async def detach(self, device: Path) -> None:
        """Disconnect `device` (no-op when it is not connected)."""
        if self._free(device.name):
            return
        rc, out = await run_command([self.nbd_client, "-d", str(device)])
        if rc != 0:
            raise VmmError(f"cannot detach {device}: {out.strip() or f'exit {rc}'}")

