"""Choosing a VMM driver: Firecracker where it can run, else QEMU (KVM or TCG).

`pick_driver()` honours an explicit name (argument, else $AENV_VMM): "qemu",
"firecracker" or "fake". Without one it takes Firecracker when its driver module, the
`firecracker` binary and a KVM usable for standard guests are all present, else QEMU.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
from typing import Any

from .accel import detect_accel
from .driver import VmmDriver
from .errors import VmmError

log = logging.getLogger(__name__)


def _firecracker(**kw: Any) -> VmmDriver:
    try:
        mod = importlib.import_module(".firecracker", __package__)
    except ImportError as exc:
        raise VmmError("the Firecracker driver is not available in this build") from exc
    driver: VmmDriver = mod.FirecrackerDriver(**kw)
    return driver


def pick_driver(name: str | None = None, **kw: Any) -> VmmDriver:
    """A driver instance; keyword arguments go to its constructor."""
    name = (name or os.environ.get("AENV_VMM") or "").strip().lower() or None
    if name == "qemu":
        from .qemu import QemuDriver

        return QemuDriver(**kw)
    if name == "firecracker":
        return _firecracker(**kw)
    if name == "fake":
        from .fake import FakeDriver

        return FakeDriver(**kw)
    if name is not None:
        raise VmmError(f"unknown VMM driver {name!r} (qemu, firecracker, fake)")
    fc_module = importlib.util.find_spec(f"{__package__}.firecracker") is not None
    if fc_module and shutil.which("firecracker") and detect_accel().name == "kvm":
        return _firecracker(**kw)
    from .qemu import QemuDriver

    return QemuDriver(**kw)
