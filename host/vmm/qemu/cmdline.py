"""Build the QEMU argv and the guest kernel command line for a `VmSpec` (pure functions).

The machine is `-M microvm` booting an uncompressed PVH `vmlinux` directly (no firmware
boot path), virtio-mmio devices, the serial console into a file and QMP on a unix socket.
The same spec always gives the same device list and ids, which snapshots need.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..driver import FileDisk, MemoryBacking, NbdDisk, TapNet, UserNet, VmSpec, balloon_cmdline


@dataclass(frozen=True, kw_only=True)
class QemuRunFiles:
    """Per-VM files the QEMU process uses, all inside the VM's work dir."""

    qmp_socket: Path
    serial_log: Path

    @classmethod
    def in_dir(cls, work_dir: Path, log_dir: Path | None = None) -> QemuRunFiles:
        """`log_dir`: where serial logs go (`<log_dir>/<work dir name>/serial.log`) instead
        of the work dir, which is usually on tmpfs (a guest's console output would be host
        RAM)."""
        serial = (log_dir / work_dir.name if log_dir is not None else work_dir) / "serial.log"
        return cls(qmp_socket=work_dir / "qmp.sock", serial_log=serial)


def qopt(value: object) -> str:
    """Escape a value for a QEMU `key=value,...` option (a comma is written as `,,`)."""
    return str(value).replace(",", ",,")


def _has_param(cmdline: str, key: str) -> bool:
    return any(tok == key or tok.startswith(key + "=") for tok in shlex.split(cmdline))


def guest_cmdline(base: str, *, accel: str, tsc_khz: int | None) -> str:
    """The kernel command line: `base` plus what this driver needs, unless already set.

    - console=ttyS0: the serial log is our only view of a failing boot.
    - panic=-1 (+ QEMU -no-reboot): a panicking guest (e.g. no init) makes QEMU exit at
      once, so boot failures are reported in milliseconds, not at the boot deadline.
    - tsc_early_khz under TCG: microvm has no other clocksource and the kernel sometimes
      fails to calibrate the TSC under emulation and hangs (measured on this host type).
    - tsc=reliable under TCG: the clocksource watchdog compares the TSC with jiffies,
      which an emulated guest on a busy host loses; it then marks the TSC unstable and
      falls back to jiffies. Without a high-resolution clocksource the guest can never
      stop its tick (tick_handle_periodic, 250 interrupts a second while idle, each one
      emulated). QEMU's TCG TSC follows the host's monotonic clock, so it is reliable.
    - norandmaps under TCG: TCG finds code it translated before by its guest virtual
      address, and address-space randomisation maps ld.so, libc and every PIE binary at
      new addresses in each process: every exec translated the whole start-up path again.
      Measured in a guest: `/bin/true` 26 -> 4 ms, `bash -c true` 52 -> 7 ms. The cost is
      the guest's own ASLR (its processes' hardening against each other); KVM guests,
      which translate nothing, keep it.
    """
    extra: list[str] = []
    if not _has_param(base, "console"):
        extra.append("console=ttyS0")
    if not _has_param(base, "panic"):
        extra.append("panic=-1")
    if accel == "tcg" and tsc_khz and not _has_param(base, "tsc_early_khz"):
        extra.append(f"tsc_early_khz={tsc_khz}")
    if accel == "tcg" and not _has_param(base, "tsc"):
        extra.append("tsc=reliable")
    if accel == "tcg" and not _has_param(base, "norandmaps"):
        extra.append("norandmaps")
    return " ".join([*extra, base.strip()]).strip()


def cpu_model(accel: str) -> str:
    """The `-cpu` of every VM: all the host's features under KVM, QEMU's most capable
    emulated CPU under TCG. Part of what a memory snapshot is keyed on (identity.py)."""
    return "max" if accel == "tcg" else "host"


# QEMU's seccomp filter in every jailed VM: no obsolete calls, no set*id, no fork/exec
# (files reach QEMU as descriptors), no scheduler, affinity or priority changes
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
NBD_RECONNECT_DELAY_S = 60
# the balloon device's QOM id: QMP `balloon` and `qom-get` of its stats find it by path
BALLOON_ID = "balloon0"
# TCG's translated-code buffer. QEMU 7.2 reserves 1 GiB and madvises it for huge pages:
# a guest that ran a few commands kept 536 MiB of it resident (2 MiB pages, each touched
# by a little code), more than its whole RAM. A guest's hot code (kernel, bash, envd)
# fits in a few MiB; when the buffer fills, QEMU flushes it and translates again.
TCG_TB_MIB = 64


# `-M microvm` without the legacy 8259 PIC and 8254 PIT. A PVH boot enters the kernel
# with no firmware to program the PIC, which still has its reset vector base 0: a PIT
# tick that reaches it before Linux remaps it arrives as vector 0 (#DE) in early boot
# and triple-faults the guest, an exit with status 0 under -no-reboot before the kernel
# printed a line (traced with `-d int,cpu_reset`: "Servicing hardware INT=0x00"; 10-13
# runs in 16 of a TCG cold boot here under load, 0 in 36 without them). Linux times
# with the TSC and the local APIC, and microvm routes its devices through the IOAPIC;
# this is also QEMU's documented minimal microvm.
MACHINE = "microvm,pit=off,pic=off"


def accel_option(accel: str, tcg_tb_mib: int = TCG_TB_MIB) -> str:
    return f"tcg,tb-size={tcg_tb_mib}" if accel == "tcg" and tcg_tb_mib else accel


def _disk_args(index: int, disk: FileDisk | NbdDisk) -> list[str]:
    drive_id = f"disk{index}"
    opts = [f"id={drive_id}", "if=none", "format=raw" if isinstance(disk, NbdDisk)
            else f"format={qopt(disk.format)}"]
    if isinstance(disk, FileDisk):
        opts.insert(1, f"file={qopt(disk.path)}")
        opts.append("cache=writeback")
    else:
        # reconnect-delay: when the block server goes away (a crash, a restart), QEMU
        # holds the guest's requests and reconnects for this long, then reruns them
        opts[1:1] = ["file.driver=nbd", "file.server.type=unix",
                     f"file.server.path={qopt(disk.socket)}", f"file.export={qopt(disk.export)}",
                     f"file.reconnect-delay={NBD_RECONNECT_DELAY_S}"]
        opts.append("cache=none")
    if disk.read_only:
        opts.append("readonly=on")
    dev = f"virtio-blk-device,drive={drive_id}"
    if disk.serial:
        dev += f",serial={qopt(disk.serial)}"
    return ["-drive", ",".join(opts), "-device", dev]


def build_argv(
    spec: VmSpec,
    *,
    files: QemuRunFiles,
    accel: str,
    tsc_khz: int | None,
    host_port: int | None = None,
    incoming: bool = False,
    qemu: str = "qemu-system-x86_64",
    tcg_tb_mib: int = TCG_TB_MIB,
    merge: bool = False,
    jailed: bool = False,
    tap_fd: int | None = None,
    readonly_private_ram: bool = False,
) -> list[str]:
    """The full argv (including an `ip netns exec` prefix for a TAP in a netns, unless
    the jail puts QEMU in the namespace and hands it the TAP as `tap_fd`).
    `merge`: guest RAM may be merged by KSM (`--ksm`). `jailed`: QEMU's seccomp filter
    (`-sandbox`), the half of the jail QEMU installs itself. `readonly_private_ram`
    (QEMU 8.2+): a share=off memory file is opened read-only and mapped copy-on-write
    (`readonly=on,rom=off`), so QEMU needs no write access to a base file it shares.

    `host_port` is the concrete host port for `UserNet` (the driver picks it when the spec
    leaves it open). `incoming=True` starts QEMU waiting for `migrate-incoming` (restore).
    """
    machine = MACHINE
    if spec.memory is not None:
        machine += ",memory-backend=mem0"
    argv = [
        qemu,
        "-name", qopt(spec.name),
        "-M", machine,
        # the host's cap, raised to what this VM asks (0, QEMU's own default, stays)
        "-accel", accel_option(accel, max(tcg_tb_mib, spec.tcg_tb_mib or 0)
                               if tcg_tb_mib else 0),
        "-cpu", cpu_model(accel),
        "-smp", str(spec.vcpus),
        "-m", f"{spec.mem_mib}M",
        "-nodefaults", "-no-user-config", "-no-reboot", "-display", "none",
        # append: a log the host truncates goes on at its new end
        "-chardev", f"file,id=ser0,path={qopt(files.serial_log)},append=on",
        "-serial", "chardev:ser0",
        "-qmp", f"unix:{qopt(files.qmp_socket)},server=on,wait=off",
    ]
    if jailed:
        argv += ["-sandbox", SANDBOX]
    if spec.kernel is not None:
        argv += ["-kernel", str(spec.kernel),
                 "-append", guest_cmdline(balloon_cmdline(spec), accel=accel, tsc_khz=tsc_khz)]
    if spec.initrd is not None:
        argv += ["-initrd", str(spec.initrd)]
    if spec.memory is not None:
        share = "on" if spec.memory.shared else "off"
        # merge=on (--ksm): ksmd may merge the pages a guest copied on write with other
        # guests' identical ones; they stay anonymous, so memory diffs (memsnap) see the
        # same private pages either way
        ro = ",readonly=on,rom=off" if readonly_private_ram and not spec.memory.shared else ""
        argv += ["-object", (f"memory-backend-file,id=mem0,size={spec.mem_mib}M,"
                             f"mem-path={qopt(spec.memory.path)},share={share}{ro},"
                             f"merge={'on' if merge else 'off'}")]
    for i, disk in enumerate(spec.disks):
        argv += _disk_args(i, disk)
    if spec.balloon:
        # free-page-reporting: the guest reports the blocks it freed and QEMU discards
        # them (over a shared base, only through the preload: preload.py); deflate-on-oom:
        # the guest takes pages back from an inflated balloon rather than OOM-kill
        argv += ["-device", (f"virtio-balloon-device,id={BALLOON_ID},"
                             "free-page-reporting=on,deflate-on-oom=on")]
    net = spec.network
    if isinstance(net, UserNet):
        if host_port is None:
            raise ValueError("UserNet needs a concrete host_port")
        fwd = f"tcp:{net.host_addr}:{host_port}-:{net.guest_port}"
        restrict = ",restrict=on" if net.restrict else ""
        argv += ["-netdev", f"user,id=net0{restrict},hostfwd={fwd}",
                 "-device", f"virtio-net-device,netdev=net0,mac={net.mac}"]
    elif isinstance(net, TapNet):
        tap = (f"tap,id=net0,fd={tap_fd}" if tap_fd is not None
               else f"tap,id=net0,ifname={qopt(net.tap)},script=no,downscript=no")
        argv += ["-netdev", tap, "-device", f"virtio-net-device,netdev=net0,mac={net.mac}"]
        if net.netns and tap_fd is None:
            argv = ["ip", "netns", "exec", net.netns, *argv]
    if incoming:
        # -S: a restored guest stays stopped until told to run (memsnap injects pages
        # between the device-state load and `cont`).
        argv += ["-incoming", "defer", "-S"]
    return argv


def config_digest(spec: VmSpec, *, accel: str, tsc_khz: int | None, qemu: str,
                  tcg_tb_mib: int = TCG_TB_MIB) -> str:
    """Hex sha256 of the argv of `spec` with per-instance parts normalised (paths,
    sockets, ports, namespace, share=, -incoming): VMs with the same digest can restore
    each other's memory snapshots."""
    mem = spec.memory
    canon = VmSpec(
        kernel=spec.kernel, cmdline=spec.cmdline, vcpus=spec.vcpus, mem_mib=spec.mem_mib,
        initrd=spec.initrd, disks=spec.disks,
        network=(TapNet(tap=spec.network.tap, guest_ip=spec.network.guest_ip, netns=None,
                        mac=spec.network.mac) if isinstance(spec.network, TapNet)
                 else spec.network),
        memory=MemoryBacking(path=Path("/MEM"), shared=False) if mem is not None else None,
        balloon=spec.balloon, name="vm")
    # merge= left at off: whether ksmd may merge guest RAM is the host's business too
    argv = build_argv(canon, files=QemuRunFiles.in_dir(Path("/WORK")), accel=accel,
                      tsc_khz=tsc_khz, host_port=0, incoming=True, qemu=qemu,
                      tcg_tb_mib=tcg_tb_mib)
    out: list[str] = []
    for a in argv:
        if a.startswith("file.driver=nbd") or "file.export=" in a:
            # host-side block options: no part of what a restore must match
            a = ",".join(p for p in a.split(",") if not p.startswith((
                "file.export=", "file.server.path=", "file.reconnect-delay=")))
        if a.startswith(("user,id=net0", "tap,id=net0")):
            a = a.split(",", 2)[0] + ",id=net0"  # how the host end is made
        if a.startswith("tcg,"):
            a = "tcg"  # the code buffer's size is the host's business
        out.append(a)
    return hashlib.sha256("\0".join(out).encode()).hexdigest()
