"""What the Firecracker driver asks of Firecracker, computed from a `VmSpec` (pure).

The request bodies for a boot and a snapshot load, the kernel command line, drive ids,
the checks for what Firecracker cannot run, the configuration digest memory snapshots
are keyed on, and whether Firecracker can run here at all. Paths in the bodies are the
ones the process sees (see jailer.py): relative to its working directory.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ..accel import _kvm_openable, _pvm_loaded
from ..driver import NbdDisk, TapNet, UserNet, VmSpec, balloon_cmdline
from ..errors import VmmError
from ..identity import binary_version
from ..vmbase import VmHost

DEFAULT_FIRECRACKER = "firecracker"
IFACE_ID = "eth0"
_DRIVE_ID = re.compile(r"^[A-Za-z0-9_]+$")  # Firecracker accepts only these in ids

Request = tuple[str, str, dict[str, Any]]


class FirecrackerHost(VmHost, Protocol):
    """What a Firecracker VM uses of the driver that made it (the driver is
    `FirecrackerDriver`; VM modules name this protocol instead, so they need not import
    the driver's module)."""

    firecracker: str
    track_dirty_pages: bool
    balloon: BalloonConfig | None
    jailer: Any   # JailerConfig | None
    block: Any    # NbdAttacher
    uids: Any     # UidPool | None: each jailed VM's own uid

    def config_digest(self, spec: VmSpec) -> str: ...

    def jailer_for_vm(self) -> Any: ...  # JailerConfig | None, with the VM's own uid

    def release_uid(self, uid: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class BalloonConfig:
    """A virtio-balloon device (PUT /balloon before start). Stats need a polling interval."""

    amount_mib: int = 0
    deflate_on_oom: bool = True
    stats_polling_interval_s: int = 1
    free_page_reporting: bool = False


def balloon_of(spec: VmSpec, configured: BalloonConfig | None) -> BalloonConfig | None:
    """The balloon of a VM of `spec`: the driver's own config, else free-page reporting
    where the spec asks for a balloon (Firecracker discards a snapshot's file-backed
    private memory with MADV_DONTNEED: the memory file is never written)."""
    if not spec.balloon:
        return None
    return configured or BalloonConfig(free_page_reporting=True)


def firecracker_usable(binary: str = DEFAULT_FIRECRACKER) -> tuple[bool, str]:
    """(usable, why): the binary is on PATH and /dev/kvm opens and is not kvm-pvm
    (Firecracker needs a KVM that runs standard guests)."""
    if shutil.which(binary) is None:
        return False, f"{binary} not found on PATH"
    if not _kvm_openable():
        return False, "/dev/kvm missing or not accessible"
    if _pvm_loaded():
        return False, "KVM is kvm-pvm (paravirtual guests only); Firecracker cannot use it"
    return True, "firecracker binary and KVM present"


def firecracker_version(binary: str) -> str:
    """First line of `firecracker --version` (e.g. "Firecracker v1.16.1"); cached per
    binary file (an upgrade in place is seen)."""
    return binary_version(binary)


def check_spec(spec: VmSpec, *, restoring: bool) -> None:
    """Raise VmmError for what Firecracker cannot run."""
    if isinstance(spec.network, UserNet):
        raise VmmError(f"{spec.name}: Firecracker supports only TAP networking; user-mode "
                       "networking (UserNet/slirp) is a QEMU feature. Use TapNet.")
    for disk in spec.disks:
        if not isinstance(disk, NbdDisk) and disk.format != "raw":
            raise VmmError(f"{spec.name}: Firecracker reads raw images only, not "
                           f"{disk.format} ({disk.path})")
        if disk.serial is not None and not _DRIVE_ID.match(disk.serial):
            raise VmmError(f"{spec.name}: drive serial {disk.serial!r} must be alphanumeric "
                           "or '_' (Firecracker uses it as the drive id)")
    drive_ids(spec)
    if not restoring and spec.kernel is None:
        raise VmmError(f"{spec.name}: Firecracker needs a kernel (vmlinux) to boot")
    # A fresh VM's RAM is anonymous (freeze_memory takes a Full snapshot instead of
    # reading a shared file); a MemoryBacking(shared=True) asked for it is ignored.
    if restoring and spec.memory is not None and spec.memory.shared:
        raise VmmError(f"{spec.name}: Firecracker maps snapshot memory copy-on-write; "
                       "restore with MemoryBacking(shared=False)")


def boot_args(base: str) -> str:
    """The kernel command line: `base` plus what Firecracker guests need, unless set.

    - console=ttyS0: the serial log is our only view of a failing boot.
    - reboot=k panic=1: Firecracker exits when the guest reboots, so a panicking guest
      (e.g. no init) ends the process within a second instead of at the boot deadline.
    - pci=off: the guest has no PCI bus unless Firecracker runs with --enable-pci;
      probing for one only slows the boot.
    """
    keys = {tok.split("=", 1)[0] for tok in shlex.split(base)}
    extra = [arg for arg in ("console=ttyS0", "reboot=k", "panic=1", "pci=off")
             if arg.split("=", 1)[0] not in keys]
    return " ".join([*extra, base.strip()]).strip()


def drive_ids(spec: VmSpec) -> list[str]:
    """The drive id of each disk: its serial (which the guest reads back as the virtio-blk
    id), else `rootfs` for the first and `diskN` for the others."""
    ids = [disk.serial or ("rootfs" if i == 0 else f"disk{i}")
           for i, disk in enumerate(spec.disks)]
    if len(set(ids)) != len(ids):
        raise VmmError(f"{spec.name}: duplicate drive ids {ids}")
    return ids


def drive_path(drive_id: str) -> str:
    """Where a drive is exposed to Firecracker (relative: see jailer.py)."""
    return f"drives/{drive_id}"


def _root_from_drive(spec: VmSpec) -> bool:
    # is_root_device makes Firecracker append root=/dev/vda; skip it when the cmdline
    # already names a root, so the two cannot disagree.
    return not any(t.startswith("root=") for t in spec.cmdline.split())


def boot_requests(spec: VmSpec, *, kernel: str, initrd: str | None,
                  track_dirty_pages: bool, balloon: BalloonConfig | None) -> list[Request]:
    """The PUTs that configure a fresh VM, then InstanceStart."""
    reqs: list[Request] = [
        ("PUT", "/machine-config", {"vcpu_count": spec.vcpus, "mem_size_mib": spec.mem_mib,
                                    "track_dirty_pages": track_dirty_pages})]
    boot: dict[str, Any] = {"kernel_image_path": kernel, "boot_args": boot_args(balloon_cmdline(spec))}
    if initrd is not None:
        boot["initrd_path"] = initrd
    reqs.append(("PUT", "/boot-source", boot))
    root = _root_from_drive(spec)
    for i, (drive_id, disk) in enumerate(zip(drive_ids(spec), spec.disks, strict=True)):
        reqs.append(("PUT", f"/drives/{drive_id}", {
            "drive_id": drive_id, "path_on_host": drive_path(drive_id),
            "is_root_device": i == 0 and root, "is_read_only": disk.read_only}))
    if isinstance(spec.network, TapNet):
        reqs.append(("PUT", f"/network-interfaces/{IFACE_ID}", {
            "iface_id": IFACE_ID, "host_dev_name": spec.network.tap,
            "guest_mac": spec.network.mac}))
    balloon = balloon_of(spec, balloon)
    if balloon is not None:
        reqs.append(("PUT", "/balloon", asdict(balloon)))
    reqs.append(("PUT", "/actions", {"action_type": "InstanceStart"}))
    return reqs


def load_request(spec: VmSpec, *, state: str, mem: str, resume: bool,
                 track_dirty_pages: bool) -> dict[str, Any]:
    """The PUT /snapshot/load body. Drives need no override: their relative paths
    resolve to this VM's own disks."""
    body: dict[str, Any] = {
        "snapshot_path": state,
        "mem_backend": {"backend_type": "File", "backend_path": mem},
        "track_dirty_pages": track_dirty_pages,
        "resume_vm": resume,
    }
    if isinstance(spec.network, TapNet):
        # The snapshot names the TAP of the saved VM; each restored VM has its own.
        body["network_overrides"] = [{"iface_id": IFACE_ID,
                                      "host_dev_name": spec.network.tap}]
    return body


def config_digest(spec: VmSpec, *, version: str, balloon: BalloonConfig | None) -> str:
    """Hex sha256 of what a snapshot depends on: Firecracker version, machine, kernel,
    boot args, drive and interface layout; not the per-instance parts (disk paths and
    sockets, TAP name, namespace, work dir, jailed or not)."""
    root = _root_from_drive(spec)
    balloon = balloon_of(spec, balloon)
    canon = {
        "vmm": "firecracker", "version": version,
        "machine": {"vcpu_count": spec.vcpus, "mem_size_mib": spec.mem_mib},
        "kernel": str(spec.kernel), "initrd": str(spec.initrd) if spec.initrd else None,
        "boot_args": boot_args(balloon_cmdline(spec)),
        "drives": [{"drive_id": d, "is_root_device": i == 0 and root,
                    "is_read_only": disk.read_only}
                   for i, (d, disk) in enumerate(zip(drive_ids(spec), spec.disks,
                                                     strict=True))],
        "network": ({"iface_id": IFACE_ID, "guest_mac": spec.network.mac}
                    if isinstance(spec.network, TapNet) else None),
        "balloon": asdict(balloon) if balloon is not None else None,
    }
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()
