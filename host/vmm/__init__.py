"""VMM drivers: one interface (driver.py), the QEMU driver (qemu/), a fake for unit
tests (fake.py), and the lookup of built kernels and images (image.py)."""

from __future__ import annotations

from .accel import AccelChoice, detect_accel, host_tsc_khz
from .driver import (
    ENVD_PORT,
    BalloonStats,
    BootTimeouts,
    Disk,
    FileDisk,
    MemoryBacking,
    NbdDisk,
    Network,
    TapNet,
    UserNet,
    Vm,
    VmmDriver,
    VmSpec,
    VmState,
)
from .errors import VmmBootTimeout, VmmError, VmmStartError, VmmStateError, VmmTimeout
from .image import GuestImage, GuestKernel, ImageNotFound, find_image, find_kernel
from .pick import pick_driver
from .qemu import QemuDriver, QemuVm, booted

__all__ = [
    "ENVD_PORT",
    "AccelChoice",
    "BalloonStats",
    "BootTimeouts",
    "Disk",
    "FileDisk",
    "GuestImage",
    "GuestKernel",
    "ImageNotFound",
    "MemoryBacking",
    "NbdDisk",
    "Network",
    "QemuDriver",
    "QemuVm",
    "TapNet",
    "UserNet",
    "Vm",
    "VmSpec",
    "VmState",
    "VmmBootTimeout",
    "VmmDriver",
    "VmmError",
    "VmmStartError",
    "VmmStateError",
    "VmmTimeout",
    "booted",
    "detect_accel",
    "find_image",
    "find_kernel",
    "host_tsc_khz",
    "pick_driver",
]
