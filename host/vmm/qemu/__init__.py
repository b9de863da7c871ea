"""The QEMU driver: `-M microvm` under KVM or TCG, driven over QMP."""

from __future__ import annotations

from .driver import QemuDriver, QemuVm, booted

__all__ = ["QemuDriver", "QemuVm", "booted"]
