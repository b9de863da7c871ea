"""Driver choice: --vmm auto|qemu|firecracker (and fake). No Firecracker binary and no
usable KVM here (PVM only): auto is checked with the KVM check monkeypatched both ways.
Auto's other condition, that Firecracker passed its VM tests on this host (the marker of
host/vmm/verified.py), is checked for real: a stand-in `firecracker` script answering
--version, the marker written and read in a temporary $AENV_CACHE."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from host.vmm import VmmDriver, VmmError, pick, verified
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


def fake_firecracker(path: Path, version: str = "Firecracker v1.16.1") -> str:
    """An executable that answers --version as Firecracker does."""
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def usable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """KVM taken as usable for Firecracker (it is not, here); $AENV_CACHE in tmp_path."""
    monkeypatch.delenv("AENV_VMM", raising=False)
    monkeypatch.setenv("AENV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pick, "firecracker_check", lambda binary="firecracker": (True, "ok"))
    monkeypatch.setattr(pick, "detect_accel",
                        lambda qemu="q": AccelChoice("kvm", "KVM runs a probe VM"))
    return tmp_path / "cache"


def auto(binary: str, caplog: pytest.LogCaptureFixture) -> tuple[VmmDriver, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="host.vmm.pick"):
        driver = pick_driver("auto", firecracker=binary, accel="kvm", jailer="off")
    return driver, caplog.text


def test_auto_is_qemu_while_firecracker_is_not_verified_here(
        usable: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fc = fake_firecracker(tmp_path / "firecracker")
    driver, logged = auto(fc, caplog)
    assert isinstance(driver, QemuDriver)
    assert ("VMM auto: qemu: QEMU with KVM (KVM runs a probe VM); firecracker found but not "
            "verified on this host: run scripts/check-kvm.sh") in logged
    # explicitly asked for, it is used all the same
    assert isinstance(pick_driver("firecracker", firecracker=fc, jailer="off"),
                      FirecrackerDriver)


def test_auto_is_firecracker_once_verified_here(
        usable: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fc = fake_firecracker(tmp_path / "firecracker")
    assert verified.mark_verified(fc) == usable / "firecracker-verified"
    driver, logged = auto(fc, caplog)
    assert isinstance(driver, FirecrackerDriver) and driver.firecracker == fc
    assert "VMM auto: firecracker: Firecracker v1.16.1 at " in logged
    assert "passed its VM tests on this host" in logged
    doc = json.loads((usable / "firecracker-verified").read_text())
    assert doc["binary"] == fc and doc["version"] == "Firecracker v1.16.1"
    assert doc["kernel"] == os.uname().release and doc["verifiedAt"]


def test_a_stale_verification_falls_back_to_qemu(
        usable: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fc = fake_firecracker(tmp_path / "firecracker")
    verified.mark_verified(fc)
    marker = usable / "firecracker-verified"
    # upgraded in place: another version answers
    fake_firecracker(tmp_path / "firecracker", "Firecracker v1.17.0-dev")
    driver, logged = auto(fc, caplog)
    assert isinstance(driver, QemuDriver)
    assert ("firecracker found but verified on this host for another setup (version "
            "'Firecracker v1.16.1' -> 'Firecracker v1.17.0-dev'): run scripts/check-kvm.sh"
            in logged)
    # another binary than the one that passed
    verified.mark_verified(fc)
    other = fake_firecracker(tmp_path / "firecracker-other", "Firecracker v1.17.0-dev")
    driver, logged = auto(other, caplog)
    assert isinstance(driver, QemuDriver) and f"binary '{fc}' -> '{other}'" in logged
    # another host kernel booted since
    doc = json.loads(marker.read_text())
    marker.write_text(json.dumps({**doc, "kernel": "5.10.0-old"}))
    driver, logged = auto(fc, caplog)
    assert isinstance(driver, QemuDriver)
    assert f"kernel '5.10.0-old' -> '{os.uname().release}'" in logged
    # a damaged marker, and a binary gone since
    marker.write_text("{not json")
    assert isinstance(auto(fc, caplog)[0], QemuDriver) and "unreadable" in caplog.text
    verified.mark_verified(fc)
    assert isinstance(auto(str(tmp_path / "gone"), caplog)[0], QemuDriver)
    assert "not found on PATH" in caplog.text


def test_mark_and_unmark_from_the_command_line(usable: Path, tmp_path: Path) -> None:
    """What scripts/check-kvm.sh runs after the firecracker row."""
    fc = fake_firecracker(tmp_path / "firecracker")
    env = {**os.environ, "AENV_CACHE": str(usable), "AENV_FIRECRACKER": fc}
    cmd = [sys.executable, "-m", "host.vmm.pick"]
    p = subprocess.run([*cmd, "--mark-verified"], env=env, capture_output=True, text=True,
                       check=False, timeout=60)
    assert p.returncode == 0 and str(usable / "firecracker-verified") in p.stdout
    assert verified.check_verified(fc)[0]
    p = subprocess.run([*cmd, "--unmark-verified"], env=env, capture_output=True, text=True,
                       check=False, timeout=60)
    assert p.returncode == 0 and not (usable / "firecracker-verified").exists()
    p = subprocess.run([*cmd, "--mark-verified"], capture_output=True, text=True, check=False,
                       env={**env, "AENV_FIRECRACKER": str(tmp_path / "none")}, timeout=60)
    assert p.returncode == 1 and "not marked verified" in p.stderr
    assert not (usable / "firecracker-verified").exists()


def test_availability_rows_on_this_host() -> None:
    rows = {name: (ok, why) for name, ok, why in pick.availability()}
    assert set(rows) == {"qemu-kvm", "firecracker", "qemu-tcg"}
    if Path("/sys/module/kvm_pvm").exists():
        assert rows["qemu-kvm"] == (False, "KVM is kvm-pvm (paravirtual guests only)")
        assert rows["firecracker"][0] is False
