"""Choosing a VMM driver: `--vmm auto|qemu|firecracker` (and "fake" for unit tests).

`pick_driver()` honours an explicit name (argument, else $AENV_VMM). "auto" (the
default) takes Firecracker when its binary exists, KVM runs standard guests
(`firecracker_usable`) and it passed its own VM tests on this host (verified.py: the
marker scripts/check-kvm.sh writes), else QEMU (KVM where usable, else TCG), and logs
why. Options that only one driver takes (`firecracker=`, `jailer=`, ... / `qemu=`,
`accel=`) are dropped for the other, so a caller passes its whole configuration either
way.

`python -m host.vmm.pick` prints, per driver, whether it can run its VM tests here and
why (scripts/check-kvm.sh reads it); `--mark-verified` / `--unmark-verified` record or
forget that Firecracker passed them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from .accel import DEFAULT_QEMU, detect_accel
from .driver import VmmDriver
from .errors import VmmError
from .verified import check_verified, mark_verified, marker_path, unmark

log = logging.getLogger(__name__)

VMM_CHOICES = ("auto", "qemu", "firecracker", "fake")
FIRECRACKER_OPTIONS = ("firecracker", "jailer", "jailer_uid", "jailer_gid", "balloon",
                       "track_dirty_pages", "block")
QEMU_OPTIONS = ("qemu", "accel", "ksm", "log_dir", "tcg_tb_mib")  # "jail": both take it
DEFAULT_FIRECRACKER = "firecracker"


def _without(kw: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k not in names}


def _firecracker(**kw: Any) -> VmmDriver:
    try:
        mod = importlib.import_module(".firecracker", __package__)
        jail = importlib.import_module(".firecracker.jailer", __package__)
    except ImportError as exc:
        raise VmmError("the Firecracker driver is not available in this build") from exc
    uid, gid = kw.pop("jailer_uid", 0), kw.pop("jailer_gid", 0)
    if isinstance(kw.get("jailer"), str):
        kw["jailer"] = jail.find_jailer(kw["jailer"], uid=uid, gid=gid)
    driver: VmmDriver = mod.FirecrackerDriver(**kw)
    return driver


def firecracker_check(binary: str = DEFAULT_FIRECRACKER) -> tuple[bool, str]:
    """(usable, why) for Firecracker: `firecracker_usable` (binary + standard KVM)."""
    try:
        mod = importlib.import_module(".firecracker.config", __package__)
    except ImportError:
        return False, "the Firecracker driver is not available in this build"
    ok, why = mod.firecracker_usable(binary)
    return bool(ok), str(why)


def auto_choice(firecracker: str = DEFAULT_FIRECRACKER, qemu: str = DEFAULT_QEMU
                ) -> tuple[str, str]:
    """("firecracker" | "qemu", why) for --vmm auto: Firecracker only where it can run
    and passed its VM tests on this host (a binary that merely starts has not shown it
    boots, snapshots and restores our guests here)."""
    ok, why = firecracker_check(firecracker)
    if ok:
        ok, why = check_verified(firecracker)
        if ok:
            return "firecracker", why
    else:
        why = f"Firecracker not usable: {why}"
    accel = detect_accel(qemu)
    return "qemu", f"QEMU with {accel.name.upper()} ({accel.reason}); {why}"


def pick_driver(name: str | None = None, **kw: Any) -> VmmDriver:
    """A driver instance; keyword arguments go to its constructor."""
    name = (name or os.environ.get("AENV_VMM") or "").strip().lower() or "auto"
    if name == "auto":
        name, why = auto_choice(kw.get("firecracker", DEFAULT_FIRECRACKER),
                                kw.get("qemu", DEFAULT_QEMU))
        log.info("VMM auto: %s: %s", name, why)
    if name == "qemu":
        from .qemu import QemuDriver

        return QemuDriver(**_without(kw, FIRECRACKER_OPTIONS))
    if name == "firecracker":
        return _firecracker(**_without(kw, QEMU_OPTIONS))
    if name == "fake":
        from .fake import FakeDriver

        return FakeDriver(**_without(kw, FIRECRACKER_OPTIONS + QEMU_OPTIONS))
    raise VmmError(f"unknown VMM driver {name!r} ({', '.join(VMM_CHOICES)})")


def availability(*, firecracker: str = DEFAULT_FIRECRACKER, qemu: str = DEFAULT_QEMU
                 ) -> list[tuple[str, bool, str]]:
    """(row, available, why) for the VM test rows: qemu-kvm, firecracker, qemu-tcg."""
    rows = []
    if shutil.which(qemu) is None:
        rows.append(("qemu-kvm", False, f"{qemu} not found on PATH"))
    else:
        accel = detect_accel(qemu)
        rows.append(("qemu-kvm", accel.name == "kvm", accel.reason))
    rows.append(("firecracker", *firecracker_check(firecracker)))
    tcg = shutil.which(qemu) is not None
    rows.append(("qemu-tcg", tcg, "software emulation, slow" if tcg
                 else f"{qemu} not found on PATH"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print `row<TAB>yes|no<TAB>reason` per driver row; with --mark-verified /
    --unmark-verified, record or forget instead that the Firecracker of $AENV_FIRECRACKER
    passed the VM suite here (the marker in $AENV_CACHE)."""
    p = argparse.ArgumentParser(prog="python -m host.vmm.pick")
    p.add_argument("--mark-verified", action="store_true")
    p.add_argument("--unmark-verified", action="store_true")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    firecracker = os.environ.get("AENV_FIRECRACKER") or DEFAULT_FIRECRACKER
    if args.mark_verified:
        try:
            print(f"firecracker verified on this host: {mark_verified(firecracker)}")
        except (VmmError, OSError) as exc:
            print(f"firecracker not marked verified: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.unmark_verified:
        if unmark():
            print(f"firecracker verification removed: {marker_path()}")
        return 0
    for row, ok, why in availability(firecracker=firecracker):
        print(f"{row}\t{'yes' if ok else 'no'}\t{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
