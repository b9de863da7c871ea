"""A template build's disk seen from inside its VM: the root filesystem grown to a bigger
device, and the free space `minFreeDiskMb` asks for checked before the memory is frozen."""

from __future__ import annotations

import collections

from host.contract import BuildFailed, BuildLog, BuildSpec

from .guest_shell import GuestShell

GROWFS_STATUS = "/run/aenv/growfs"


async def grow_filesystem(shell: GuestShell, spec: BuildSpec, log: BuildLog,
                          disk_mib: int) -> None:
    """The root filesystem grown to the (bigger) device: our init does it at boot when the
    command line says builds.GROWFS_FLAG, or at `switch-root --growfs` (rootfs/init/init.c),
    and leaves its outcome in GROWFS_STATUS (read through envd's files API: no program
    needed); an init older than that (a template built before, as a base) left none: the
    kernel's online resize from python3 in the guest, as it did then (EXT4_IOC_RESIZE_FS
    on /; resize2fs itself fails on a root mounted as /dev/root: "Device or resource
    busy")."""
    said = await shell.read_file(GROWFS_STATUS, limit=4096)
    status = said.decode(errors="replace").strip() if said is not None else ""
    if not status:
        # the last lines only: the guest may print without end
        out: collections.deque[str] = collections.deque(maxlen=3)
        script = ("python3 -c 'import fcntl,os,struct; "
                  "n=int(open(\"/sys/block/vda/size\").read())*512//os.statvfs(\"/\").f_frsize; "
                  "fd=os.open(\"/\",os.O_RDONLY); "
                  "fcntl.ioctl(fd,0x40086610,struct.pack(\"Q\",n))'")
        code = await shell.run(script, user="root", on_output=lambda _s, line: out.append(line))
        status = "grown" if code == 0 else (" | ".join(out)
                                             or "the image has no python3 to grow it")
    if not status.startswith("grown"):
        if spec.min_free_disk_mb:
            raise BuildFailed(f"growing the disk for minFreeDiskMb failed: {status}",
                              step="base")
        log("warn", f"the image's filesystem was not grown ({status}): disk size unchanged",
            "base")
        return
    log("info", f"disk grown to {disk_mib} MiB", "base")


async def check_free_disk(shell: GuestShell, spec: BuildSpec, log: BuildLog) -> None:
    need = spec.min_free_disk_mb
    if not need:
        return
    out: collections.deque[str] = collections.deque(maxlen=1)  # the last line only
    await shell.run("df -Pm / | tail -1", user="root",
                    on_output=lambda _s, line: out.append(line))
    try:
        free = int(out[-1].split()[3])
    except (IndexError, ValueError):
        raise BuildFailed(f"cannot read the free disk space: {list(out)}",
                          step="finalize") from None
    if free < need:
        raise BuildFailed(f"{free} MiB free on the disk, {need} MiB asked (minFreeDiskMb)",
                          step="finalize")
    log("info", f"{free} MiB free on the disk", "finalize")
