"""Driver choice: --vmm auto|qemu|firecracker (and fake). No Firecracker binary and no
usable KVM here (PVM only): auto is checked with the checks monkeypatched both ways."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from host.vmm import VmmError, pick
from host.vmm.accel import AccelChoice
from host.vmm.fake import FakeDriver
from host.vmm.firecracker.driver import FirecrackerDriver
from host.vmm.firecracker.jailer import JailerConfig
from host.vmm.pick import pick_driver
from host.vmm.qemu.driver import QemuDriver


def test_explicit_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_VMM", raising=False)
    assert isinstance(pick_driver("qemu", accel="tcg"), QemuDriver)
    assert isinstance(pick_driver("fake"), FakeDriver)
    monkeypatch.setenv("AENV_VMM", "fake")
    assert isinstance(pick_driver(), FakeDriver)
    with pytest.raises(VmmError, match="unknown"):
        pick_driver("vbox")


def test_each_driver_takes_only_its_options(tmp_path: Path) -> None:
    opts = {"run_dir": tmp_path, "firecracker": "/opt/fc", "jailer": "off", "accel": "tcg",
            "track_dirty_pages": False}
    q = pick_driver("qemu", **opts)
    assert isinstance(q, QemuDriver) and q.run_dir == tmp_path
    f = pick_driver("firecracker", **opts)
    assert isinstance(f, FirecrackerDriver)
    assert f.firecracker == "/opt/fc" and f.jailer is None and not f.track_dirty_pages


def test_jailer_setting_is_resolved(tmp_path: Path) -> None:
    jailer = tmp_path / "jailer"
    jailer.write_text("#!/bin/sh\n")
    jailer.chmod(0o755)
    f = pick_driver("firecracker", jailer=str(jailer), jailer_uid=7, jailer_gid=8)
    assert isinstance(f, FirecrackerDriver)
    assert f.jailer == JailerConfig(binary=str(jailer), uid=7, gid=8)


def test_auto_is_qemu_when_firecracker_cannot_run_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("AENV_VMM", raising=False)
    monkeypatch.setattr(pick, "firecracker_check",
                        lambda binary="firecracker": (False, f"{binary} not found on PATH"))
    monkeypatch.setattr(pick, "detect_accel",
                        lambda qemu="q": AccelChoice("tcg", "KVM is kvm-pvm"))
    with caplog.at_level(logging.INFO, logger="host.vmm.pick"):
        assert isinstance(pick_driver(firecracker="/opt/fc", jailer="auto"), QemuDriver)
    assert "VMM auto: qemu: QEMU with TCG (KVM is kvm-pvm); Firecracker not usable: " \
           "/opt/fc not found on PATH" in caplog.text


def test_auto_is_firecracker_where_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pick, "firecracker_check", lambda binary="firecracker": (True, "ok"))
    driver = pick_driver("auto", firecracker="/opt/fc", accel="kvm", jailer="off")
    assert isinstance(driver, FirecrackerDriver) and driver.firecracker == "/opt/fc"


def test_availability_rows_on_this_host() -> None:
    rows = {name: (ok, why) for name, ok, why in pick.availability()}
    assert set(rows) == {"qemu-kvm", "firecracker", "qemu-tcg"}
    if Path("/sys/module/kvm_pvm").exists():
        assert rows["qemu-kvm"] == (False, "KVM is kvm-pvm (paravirtual guests only)")
        assert rows["firecracker"][0] is False
