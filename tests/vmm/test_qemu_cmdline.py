"""argv and kernel command line building (no QEMU needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from host.vmm import FileDisk, MemoryBacking, NbdDisk, TapNet, UserNet, VmSpec
from host.vmm.qemu.cmdline import (
    MACHINE,
    TCG_TB_MIB,
    QemuRunFiles,
    build_argv,
    config_digest,
    guest_cmdline,
    qopt,
)

FILES = QemuRunFiles.in_dir(Path("/w"))


def _opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_basic_tcg_argv() -> None:
    spec = VmSpec(kernel=Path("/k/vmlinux"), cmdline="root=/dev/vda", vcpus=2, mem_mib=768)
    argv = build_argv(spec, files=FILES, accel="tcg", tsc_khz=2596118, host_port=4321)
    assert argv[0] == "qemu-system-x86_64"
    assert _opt(argv, "-M") == [MACHINE]
    assert _opt(argv, "-accel") == [f"tcg,tb-size={TCG_TB_MIB}"]
    assert _opt(argv, "-cpu") == ["max"]
    assert _opt(argv, "-smp") == ["2"] and _opt(argv, "-m") == ["768M"]
    for flag in ("-nodefaults", "-no-reboot"):
        assert flag in argv
    assert _opt(argv, "-display") == ["none"]
    assert _opt(argv, "-kernel") == ["/k/vmlinux"]
    assert _opt(argv, "-append") == [  # the last: the balloon's (driver.balloon_cmdline)
        ("console=ttyS0 panic=-1 tsc_early_khz=2596118 tsc=reliable norandmaps root=/dev/vda "
         "page_reporting.page_reporting_order=7 page_reporting.page_reporting_delay_ms=20 "
         "sysctl.vm.percpu_pagelist_high_fraction=512")]
    # append: the log may be truncated under QEMU when it is rotated
    assert _opt(argv, "-chardev") == ["file,id=ser0,path=/w/serial.log,append=on"]
    assert _opt(argv, "-serial") == ["chardev:ser0"]
    assert _opt(argv, "-qmp") == ["unix:/w/qmp.sock,server=on,wait=off"]
    assert _opt(argv, "-netdev") == ["user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:4321-:49983"]
    assert _opt(argv, "-device") == [
        "virtio-balloon-device,id=balloon0,free-page-reporting=on,deflate-on-oom=on",
        "virtio-net-device,netdev=net0,mac=52:54:00:12:34:56"]
    assert "-incoming" not in argv and "-object" not in argv


def test_balloon_is_part_of_the_machine() -> None:
    """Every VM has one unless its spec says not; a snapshot with one does not restore
    into a VM without (the digest differs)."""
    spec = VmSpec(kernel=Path("/k"), network=None)
    without = VmSpec(kernel=Path("/k"), network=None, balloon=False)
    assert not any("balloon" in a for a in build_argv(without, files=FILES, accel="tcg",
                                                       tsc_khz=None))
    kw = {"accel": "tcg", "tsc_khz": None, "qemu": "qemu-system-x86_64"}
    assert config_digest(spec, **kw) != config_digest(without, **kw)  # type: ignore[arg-type]


def test_kvm_uses_host_cpu_and_no_tsc_hint() -> None:
    spec = VmSpec(kernel=Path("/k"), network=None)
    argv = build_argv(spec, files=FILES, accel="kvm", tsc_khz=2596118)
    assert _opt(argv, "-cpu") == ["host"]
    assert _opt(argv, "-accel") == ["kvm"]  # no TCG code buffer to size
    assert "tsc_early_khz" not in _opt(argv, "-append")[0]
    assert "tsc=" not in _opt(argv, "-append")[0]  # kvm-clock is the clocksource
    assert "-netdev" not in argv


def test_disks_in_order_with_escaping() -> None:
    spec = VmSpec(kernel=Path("/k"), network=None, disks=(
        FileDisk(path=Path("/img/a,b.ext4"), read_only=True, serial="base"),
        NbdDisk(socket=Path("/run/nbd.sock"), export="upper"),
        FileDisk(path=Path("/img/c.qcow2"), format="qcow2"),
    ))
    argv = build_argv(spec, files=FILES, accel="tcg", tsc_khz=None)
    assert _opt(argv, "-drive") == [
        "id=disk0,file=/img/a,,b.ext4,if=none,format=raw,cache=writeback,readonly=on",
        ("id=disk1,file.driver=nbd,file.server.type=unix,file.server.path=/run/nbd.sock,"
         "file.export=upper,file.reconnect-delay=60,if=none,format=raw,cache=none"),
        "id=disk2,file=/img/c.qcow2,if=none,format=qcow2,cache=writeback",
    ]
    assert _opt(argv, "-device") == [
        "virtio-blk-device,drive=disk0,serial=base",
        "virtio-blk-device,drive=disk1",
        "virtio-blk-device,drive=disk2",
        "virtio-balloon-device,id=balloon0,free-page-reporting=on,deflate-on-oom=on",
    ]


@pytest.mark.parametrize("shared", [True, False])
def test_memory_backend_file(shared: bool) -> None:
    spec = VmSpec(kernel=Path("/k"), mem_mib=256, network=None,
                  memory=MemoryBacking(path=Path("/snap/mem"), shared=shared))
    argv = build_argv(spec, files=FILES, accel="tcg", tsc_khz=None, incoming=True)
    assert _opt(argv, "-M") == [f"{MACHINE},memory-backend=mem0"]
    share = "on" if shared else "off"
    assert _opt(argv, "-object") == [
        f"memory-backend-file,id=mem0,size=256M,mem-path=/snap/mem,share={share},merge=off"]
    assert _opt(argv, "-incoming") == ["defer"]
    assert argv[-3:] == ["-incoming", "defer", "-S"]


def test_tap_in_netns_prefixes_ip_netns_exec() -> None:
    spec = VmSpec(kernel=Path("/k"), network=TapNet(tap="tap0", guest_ip="10.11.0.2",
                                                    netns="sbx1", mac="02:00:00:00:00:01"))
    argv = build_argv(spec, files=FILES, accel="tcg", tsc_khz=None)
    assert argv[:5] == ["ip", "netns", "exec", "sbx1", "qemu-system-x86_64"]
    assert _opt(argv, "-netdev") == ["tap,id=net0,ifname=tap0,script=no,downscript=no"]


def test_user_net_needs_concrete_port() -> None:
    with pytest.raises(ValueError):
        build_argv(VmSpec(kernel=Path("/k"), network=UserNet()), files=FILES, accel="tcg",
                   tsc_khz=None)


@pytest.mark.parametrize(("base", "expected"), [
    ("", "console=ttyS0 panic=-1 tsc_early_khz=1000 tsc=reliable norandmaps"),
    ("console=hvc0 panic=5 quiet",
     "tsc_early_khz=1000 tsc=reliable norandmaps console=hvc0 panic=5 quiet"),
    ("tsc_early_khz=7 init=/sbin/init",
     "console=ttyS0 panic=-1 tsc=reliable norandmaps tsc_early_khz=7 init=/sbin/init"),
    ("tsc=unstable", "console=ttyS0 panic=-1 tsc_early_khz=1000 norandmaps tsc=unstable"),
    ("norandmaps", "console=ttyS0 panic=-1 tsc_early_khz=1000 tsc=reliable norandmaps"),
])
def test_guest_cmdline_adds_only_missing(base: str, expected: str) -> None:
    assert guest_cmdline(base, accel="tcg", tsc_khz=1000) == expected


def test_tcg_code_buffer_is_bounded_and_not_part_of_the_digest() -> None:
    spec = VmSpec(kernel=Path("/k"), network=None)
    assert _opt(build_argv(spec, files=FILES, accel="tcg", tsc_khz=None, tcg_tb_mib=16),
                "-accel") == ["tcg,tb-size=16"]
    assert _opt(build_argv(spec, files=FILES, accel="tcg", tsc_khz=None, tcg_tb_mib=0),
                "-accel") == ["tcg"]  # 0: QEMU's own default
    # a VM that asks for more (a template build's) gets it; never less than the cap
    build_vm = dataclasses.replace(spec, tcg_tb_mib=128)
    for cap, want in ((64, 128), (256, 256), (0, 0)):
        assert _opt(build_argv(build_vm, files=FILES, accel="tcg", tsc_khz=None,
                               tcg_tb_mib=cap), "-accel") == \
            [f"tcg,tb-size={want}" if want else "tcg"]
    # a VM restores another's memory whatever the host gives TCG for translated code
    assert config_digest(spec, accel="tcg", tsc_khz=None, qemu="q", tcg_tb_mib=16) == \
        config_digest(spec, accel="tcg", tsc_khz=None, qemu="q", tcg_tb_mib=256) == \
        config_digest(build_vm, accel="tcg", tsc_khz=None, qemu="q", tcg_tb_mib=16)


def test_ksm_marks_guest_ram_mergeable_outside_the_digest() -> None:
    spec = VmSpec(kernel=Path("/k"), mem_mib=256, network=None,
                  memory=MemoryBacking(path=Path("/snap/mem"), shared=False))
    merged = _opt(build_argv(spec, files=FILES, accel="tcg", tsc_khz=None, merge=True),
                  "-object")
    assert merged == [("memory-backend-file,id=mem0,size=256M,mem-path=/snap/mem,share=off,"
                       "merge=on")]
    # snapshots taken with --ksm restore without it and back: one digest
    from host.vmm.qemu.driver import QemuDriver
    on, off = QemuDriver(accel="tcg", ksm=True), QemuDriver(accel="tcg")
    assert on.config_digest(spec) == off.config_digest(spec)


def test_qopt_escapes_commas() -> None:
    assert qopt("a,b,,c") == "a,,b,,,,c"


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        VmSpec(kernel=Path("/k"), vcpus=0)
    with pytest.raises(ValueError):
        VmSpec(kernel=Path("/k"), mem_mib=1)
