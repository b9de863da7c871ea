"""Whether Firecracker passed its own VM tests on this host: the marker
`scripts/check-kvm.sh` writes when the firecracker row of the VM suite passes, and that
`--vmm auto` requires before it picks Firecracker (pick.py). A binary found on PATH with
a KVM that opens is not enough: the driver has to have booted, snapshotted and restored
guests here.

    <AENV_CACHE>/firecracker-verified   JSON {"binary": realpath, "version": first line
                                         of `--version`, "kernel": host `uname -r`,
                                         "verifiedAt": ISO time}

The marker matches while the binary found for the setting resolves to the same file
and reports the same version and the host runs the same kernel: an upgraded Firecracker
or a new host kernel has to pass again. An explicit `--vmm firecracker` ignores it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from host.private import write_private

from .errors import VmmError
from .identity import binary_version
from .image import cache_dir

MARKER = "firecracker-verified"
HOW = "run scripts/check-kvm.sh"


@dataclass(frozen=True)
class Verification:
    """What a verification was made against."""

    binary: str    # the resolved path of the binary
    version: str   # first line of its --version
    kernel: str    # the host's kernel release

    @classmethod
    def current(cls, binary: str) -> Verification:
        """This host's Firecracker (a name on PATH or a path) as it is now."""
        found = shutil.which(binary)
        if found is None:
            raise VmmError(f"{binary} not found on PATH")
        return cls(binary=os.path.realpath(found), version=binary_version(found),
                   kernel=os.uname().release)


def marker_path(cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / MARKER


def mark_verified(binary: str, cache: Path | None = None) -> Path:
    """Record that `binary` passed the VM suite on this host; returns the marker's path."""
    now = Verification.current(binary)
    path = marker_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**asdict(now), "verifiedAt": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    write_private(path, (json.dumps(doc, indent=1) + "\n").encode())   # atomic
    return path


def unmark(cache: Path | None = None) -> bool:
    """Forget a verification (the suite failed); whether there was one."""
    try:
        marker_path(cache).unlink()
    except FileNotFoundError:
        return False
    return True


def check_verified(binary: str, cache: Path | None = None) -> tuple[bool, str]:
    """(verified, why) for `binary` on this host."""
    path = marker_path(cache)
    try:
        doc = json.loads(path.read_text())
        recorded = Verification(binary=str(doc["binary"]), version=str(doc["version"]),
                                kernel=str(doc["kernel"]))
    except FileNotFoundError:
        return False, f"firecracker found but not verified on this host: {HOW}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, (f"firecracker found but its verification {path} is unreadable "
                       f"({exc}): {HOW}")
    try:
        now = Verification.current(binary)
    except VmmError as exc:
        return False, f"firecracker cannot be checked against its verification ({exc}): {HOW}"
    changed = [f"{name} {old!r} -> {new!r}"
               for name, old, new in (("binary", recorded.binary, now.binary),
                                      ("version", recorded.version, now.version),
                                      ("kernel", recorded.kernel, now.kernel)) if old != new]
    if changed:
        return False, (f"firecracker found but verified on this host for another setup "
                       f"({'; '.join(changed)}): {HOW}")
    return True, (f"{now.version} at {now.binary} passed its VM tests on this host "
                  f"({doc.get('verifiedAt', 'unknown time')}, kernel {now.kernel})")


__all__ = ["MARKER", "Verification", "check_verified", "mark_verified", "marker_path",
           "unmark"]
