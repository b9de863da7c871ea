"""Accelerator choice (KVM or TCG) and the host TSC frequency, both detected once and cached.

KVM is used only when it can run a standard guest. Some hosts expose /dev/kvm backed by
kvm-pvm (a paravirtual-only KVM): there QEMU aborts at vCPU reset ("failed to set MSR
0x10a") or crawls, so we fall back to TCG with a warning. The check is cheap first
(/dev/kvm openable, no kvm_pvm module) and then a probe launch of QEMU with `-accel kvm
-S` that must survive vCPU reset.

`AENV_ACCEL=kvm|tcg` forces the choice (no probe).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_QEMU = "qemu-system-x86_64"
PVM_MODULE_PATHS = (Path("/sys/module/kvm_pvm"),)
_PROBE_SURVIVE_S = 1.5


@dataclass(frozen=True)
class AccelChoice:
    """The accelerator to pass to `-accel` and why it was chosen."""

    name: str  # "kvm" | "tcg"
    reason: str


def _kvm_openable(dev: Path = Path("/dev/kvm")) -> bool:
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def _pvm_loaded(paths: tuple[Path, ...] = PVM_MODULE_PATHS) -> bool:
    return any(p.exists() for p in paths)


def probe_kvm(qemu: str = DEFAULT_QEMU, survive_s: float = _PROBE_SURVIVE_S) -> tuple[bool, str]:
    """Launch QEMU with KVM, vCPUs stopped (-S); usable if it is still alive after
    `survive_s` (a broken KVM aborts during vCPU reset, well before that)."""
    argv = [qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "64", "-smp", "1",
            "-nodefaults", "-display", "none", "-no-reboot", "-S"]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        return False, f"cannot run {qemu}: {exc}"
    try:
        proc.wait(timeout=survive_s)
    except subprocess.TimeoutExpired:
        return True, "KVM probe VM survived vCPU reset"
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    msg = err.decode(errors="replace").strip().splitlines()
    return False, f"KVM probe exited {proc.returncode}: {msg[0] if msg else ''}"


@functools.cache
def detect_accel(qemu: str = DEFAULT_QEMU) -> AccelChoice:
    """KVM if it runs standard guests here, else TCG (logged as a warning). Cached."""
    forced = os.environ.get("AENV_ACCEL", "").strip().lower()
    if forced in ("kvm", "tcg"):
        return AccelChoice(forced, "forced by AENV_ACCEL")
    if not _kvm_openable():
        choice = AccelChoice("tcg", "/dev/kvm missing or not accessible")
    elif _pvm_loaded():
        choice = AccelChoice("tcg", "KVM is kvm-pvm (paravirtual guests only)")
    else:
        ok, why = probe_kvm(qemu)
        choice = AccelChoice("kvm", why) if ok else AccelChoice("tcg", why)
    if choice.name == "tcg":
        log.warning("QEMU will use TCG (slow software emulation): %s", choice.reason)
    return choice


_TSC_PATTERNS = (
    re.compile(r"Refined TSC clocksource calibration: ([0-9.]+) MHz"),
    re.compile(r"tsc: Detected ([0-9.]+) MHz processor"),
)


def parse_tsc_khz(dmesg: str = "", cpuinfo: str = "") -> int | None:
    """TSC kHz from kernel log text (refined value first) or /proc/cpuinfo 'cpu MHz'."""
    for pat in _TSC_PATTERNS:
        found = pat.findall(dmesg)
        if found:
            return round(float(found[-1]) * 1000)
    m = re.search(r"^cpu MHz\s*:\s*([0-9.]+)", cpuinfo, re.MULTILINE)
    if m:
        return round(float(m.group(1)) * 1000)
    return None


@functools.cache
def host_tsc_khz() -> int | None:
    """The host TSC frequency in kHz, for the guest's `tsc_early_khz=` under TCG. Cached."""
    dmesg = ""
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5,
                               check=False).stdout
    except (OSError, subprocess.SubprocessError):
        pass
    cpuinfo = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    khz = parse_tsc_khz(dmesg, cpuinfo)
    if khz is None:
        log.warning("could not find the host TSC frequency; TCG guests may hang at boot")
    return khz
