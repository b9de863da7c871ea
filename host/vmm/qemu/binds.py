"""What a jailed QEMU opens besides its work dir: each path bound into the jail's root at
its host path (host/vmm/jail), readable or writable as QEMU uses it."""

from __future__ import annotations

import os
from pathlib import Path

from ..driver import NbdDisk, VmSpec
from ..errors import VmmStartError
from ..jail import Bind


def jail_binds(spec: VmSpec, *, preload: Path | None, log_dir: Path | None) -> list[Bind]:
    """Kernel and initrd, the preload, the VM's log dir, the memory file (a private base
    read-only; a shared scratch file made here at its full size, RLIMIT_FSIZE forbids QEMU
    to grow it), the disks (a stack's own NBD socket directory; file disks and their
    backing file)."""
    binds = [Bind(p) for p in (spec.kernel, spec.initrd, preload) if p is not None]
    if log_dir is not None:
        binds.append(Bind(log_dir, writable=True))
    if spec.memory is not None:
        path = spec.memory.path
        if spec.memory.shared:
            size = spec.mem_mib << 20
            with open(path, "ab") as f:
                if os.fstat(f.fileno()).st_size < size:
                    f.truncate(size)
            path.chmod(0o600)
            binds.append(Bind(path, writable=True))  # handed to the VM's uid
        else:
            if not path.stat().st_mode & 0o004:
                path.chmod(0o444)  # a frozen base: never written, read by every VM
            binds.append(Bind(path))
    for disk in spec.disks:
        if isinstance(disk, NbdDisk):
            if disk.socket.parent.parent.name != "x":
                raise VmmStartError(
                    f"{spec.name}: a jailed VM needs its stack's own NBD socket "
                    f"(<socket dir>/x/<stack>/nbd.sock), not {disk.socket}")
            binds.append(Bind(disk.socket.parent, writable=True))
        else:
            binds.append(Bind(disk.path, writable=not disk.read_only))
            if disk.backing is not None:
                binds.append(Bind(disk.backing))
    return binds
