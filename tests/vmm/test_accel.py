"""Accelerator and TSC detection (no VM)."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from host.vmm import accel


@pytest.fixture(autouse=True)
def _clear_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("AENV_ACCEL", raising=False)
    accel.detect_accel.cache_clear()
    yield
    accel.detect_accel.cache_clear()


def _script(tmp_path: Path, body: str) -> str:
    p = tmp_path / "fake-qemu"
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return str(p)


def test_no_kvm_device_falls_back_to_tcg(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(accel, "_kvm_openable", lambda: False)
    choice = accel.detect_accel("unused")
    assert choice.name == "tcg" and "/dev/kvm" in choice.reason
    assert "TCG" in caplog.text


def test_pvm_kvm_falls_back_to_tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accel, "_kvm_openable", lambda: True)
    monkeypatch.setattr(accel, "_pvm_loaded", lambda: True)
    assert accel.detect_accel("unused").name == "tcg"


def test_probe_decides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(accel, "_kvm_openable", lambda: True)
    monkeypatch.setattr(accel, "_pvm_loaded", lambda: False)
    monkeypatch.setattr(accel, "probe_kvm", lambda qemu: (False, "aborted"))
    assert accel.detect_accel("q1") == accel.AccelChoice("tcg", "aborted")
    monkeypatch.setattr(accel, "probe_kvm", lambda qemu: (True, "ok"))
    assert accel.detect_accel("q2").name == "kvm"


def test_forced_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_ACCEL", "kvm")
    assert accel.detect_accel("unused").name == "kvm"


def test_probe_kvm_with_fake_qemu(tmp_path: Path) -> None:
    dying = _script(tmp_path, "echo 'error: failed to set MSR 0x10a' >&2; exit 134")
    ok, why = accel.probe_kvm(dying, survive_s=2)
    assert not ok and "MSR" in why
    surviving = _script(tmp_path, "exec sleep 30")
    ok, _ = accel.probe_kvm(surviving, survive_s=0.3)
    assert ok
    assert not accel.probe_kvm(str(tmp_path / "missing"))[0]


def test_detection_on_a_pvm_host_is_tcg_whatever_the_probe_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a kvm-pvm host detection picks TCG from the module check alone. The probe is not
    trusted there: on some host kernels QEMU with `-accel kvm -S` survives vCPU reset
    (measured on this machine kind, Dec 2026) while a real guest still hangs."""
    if not accel._pvm_loaded():
        pytest.skip("not a kvm-pvm host")
    monkeypatch.delenv("AENV_ACCEL", raising=False)
    accel.detect_accel.cache_clear()
    try:
        choice = accel.detect_accel()
    finally:
        accel.detect_accel.cache_clear()
    assert choice.name == "tcg" and "pvm" in choice.reason


@pytest.mark.parametrize(("dmesg", "cpuinfo", "khz"), [
    (("[0.0] tsc: Detected 2596.118 MHz processor\n"
      "[1.0] tsc: Refined TSC clocksource calibration: 2596.125 MHz\n"), "", 2596125),
    ("[0.0] tsc: Detected 2596.118 MHz processor\n", "cpu MHz\t\t: 1000.0\n", 2596118),
    ("", "model name: x\ncpu MHz\t\t: 2596.118\n", 2596118),
    ("", "", None),
])
def test_parse_tsc_khz(dmesg: str, cpuinfo: str, khz: int | None) -> None:
    assert accel.parse_tsc_khz(dmesg, cpuinfo) == khz


def test_host_tsc_khz_is_plausible() -> None:
    khz = accel.host_tsc_khz()
    assert khz is None or 100_000 < khz < 10_000_000
