"""`VmmIdentity` (issue 14 item 20): what each driver reports its memory snapshots depend
on besides the spec (VMM version, accelerator, -cpu, host CPU when the guest sees it),
from the real drivers over fake binaries; an in-place upgrade is seen; comparisons treat
missing fields as unknown."""

from __future__ import annotations

from pathlib import Path

from host.vmm.driver import UserNet, VmSpec
from host.vmm.identity import VmmIdentity, describe, host_cpu_model
from host.vmm.qemu.cmdline import QemuRunFiles, build_argv
from host.vmm.qemu.driver import QemuDriver

from .fakefc import FakeFc


def _fake_qemu(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "{version}" && '
                    f'echo "Copyright (c) 2003-2022 Fabrice Bellard" && exit 0\nexit 1\n')
    path.chmod(0o755)
    return path


def test_qemu_identity_names_version_accelerator_and_cpu(tmp_path: Path) -> None:
    qemu = _fake_qemu(tmp_path / "bin" / "qemu-system-x86_64",
                      "QEMU emulator version 7.2.19 (Debian 1:7.2+dfsg-7)")
    tcg = QemuDriver(qemu=str(qemu), accel="tcg", run_dir=tmp_path / "vms").identity()
    assert tcg == VmmIdentity(vmm="qemu", version="QEMU emulator version 7.2.19 (Debian "
                              "1:7.2+dfsg-7)", accel="tcg", cpu="max")
    spec = VmSpec(kernel=Path("/k"), network=UserNet(host_port=1), name="x")
    argv = build_argv(spec, files=QemuRunFiles.in_dir(tmp_path), accel="tcg", tsc_khz=None,
                      host_port=1)
    assert argv[argv.index("-cpu") + 1] == tcg.cpu  # what the VM really gets
    kvm = QemuDriver(qemu=str(qemu), accel="kvm", run_dir=tmp_path / "vms").identity()
    assert (kvm.accel, kvm.cpu, kvm.host_cpu) == ("kvm", "host", host_cpu_model())
    # the binary is upgraded in place: the next identity says so
    _fake_qemu(qemu, "QEMU emulator version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)")
    new = QemuDriver(qemu=str(qemu), accel="tcg", run_dir=tmp_path / "vms").identity()
    assert new.version.startswith("QEMU emulator version 8.2.2")
    assert new.differences(tcg.to_json()) == [
        ("version", tcg.version, new.version)]


def test_firecracker_identity(fake_fc: FakeFc) -> None:
    ident = fake_fc.driver().identity()
    assert ident.vmm == "firecracker" and ident.version.startswith("Firecracker v1.16.1")
    assert (ident.accel, ident.cpu, ident.host_cpu) == ("kvm", "host", host_cpu_model())


def test_differences_skip_what_was_not_recorded() -> None:
    cur = VmmIdentity(vmm="qemu", version="QEMU emulator version 8.2.2", accel="tcg",
                      cpu="max")
    assert cur.differences(None) == [] and cur.differences({}) == []
    assert cur.differences({"vmm": "qemu", "accel": "tcg"}) == []
    assert cur.differences({"accel": "kvm", "cpu": "host", "host_cpu": "EPYC"}) == [
        ("accel", "kvm", "tcg"), ("cpu", "host", "max")]  # no host CPU model here: unknown
    assert cur.describe() == "QEMU emulator version 8.2.2 (tcg, -cpu max)"
    assert describe({"vmm": "qemu", "accel": "kvm", "cpu": "host", "host_cpu": "EPYC"}) == \
        "qemu of unknown version (kvm, -cpu host, on EPYC)"
