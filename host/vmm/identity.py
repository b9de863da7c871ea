"""`VmmIdentity`: what a memory snapshot depends on besides its VM's spec.

A guest's saved CPU and device state loads only into the VMM that wrote it, or one close
enough: the same VMM and version, the same accelerator (tcg / kvm) and the same guest CPU
model (QEMU's `-cpu`; with `host` that is the host's CPU). Each memory snapshot records
the identity of the driver that took it; a restore under another one is refused naming
both (`differences`). Fields a snapshot does not record (older snapshots) are unknown and
accepted.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .errors import VmmError


@dataclass(frozen=True, kw_only=True)
class VmmIdentity:
    vmm: str                     # "qemu" | "firecracker" | "fake"
    version: str                 # first line of `<vmm> --version`
    accel: str                   # "kvm" | "tcg"
    cpu: str                     # the guest CPU model: QEMU's -cpu ("host" | "max")
    host_cpu: str | None = None  # the host CPU model, when the guest sees it (cpu "host")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def differences(self, recorded: Mapping[str, Any] | None) -> list[tuple[str, str, str]]:
        """(field, recorded, current) for each field `recorded` holds (a snapshot's
        `vmm`) that differs from this identity; a field either side does not know
        (older snapshots; no host CPU model here) is not compared."""
        out = []
        for f in fields(self):
            want = (recorded or {}).get(f.name)
            have = getattr(self, f.name)
            if want is not None and have is not None and str(want) != str(have):
                out.append((f.name, str(want), str(have)))
        return out

    def describe(self) -> str:
        return describe(self.to_json())


def describe(identity: Mapping[str, Any]) -> str:
    """A recorded identity for people: `QEMU emulator version 7.2.19 (tcg, -cpu max)`."""
    extra = [str(identity["accel"])] if identity.get("accel") else []
    if identity.get("cpu"):
        extra.append(f"-cpu {identity['cpu']}")
    if identity.get("host_cpu"):
        extra.append(f"on {identity['host_cpu']}")
    what = identity.get("version") or f"{identity.get('vmm') or 'a VMM'} of unknown version"
    return f"{what} ({', '.join(extra)})" if extra else str(what)


def binary_version(binary: str) -> str:
    """First line of `binary --version`; cached per binary file (an upgrade in place, a
    new mtime or size, is seen)."""
    path = shutil.which(binary) or binary
    try:
        st = os.stat(path)
    except OSError as exc:
        raise VmmError(f"cannot ask {binary} for its version: {exc}") from exc
    return _version(path, st.st_mtime_ns, st.st_size)


@functools.cache
def _version(binary: str, mtime_ns: int, size: int) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10, check=True, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise VmmError(f"cannot ask {binary} for its version: {exc}") from exc
    line = out.strip().splitlines()[0] if out.strip() else ""
    if not line:
        raise VmmError(f"{binary} --version printed nothing")
    return line


@functools.cache
def host_cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The host CPU's `model name` (what a guest with `-cpu host` sees). Cached."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return None
