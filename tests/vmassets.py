"""What every VM test needs from this machine: the guest kernel and image that `make kernel
image` builds, and QEMU. `make test` builds the assets first (cached by hash, a no-op when
built), so a VM test that finds them missing fails with what to run: a suite that skipped
every VM test for want of them would pass while testing nothing (`make test-fast` is the
quick path without VMs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CACHE = Path(os.environ.get("AENV_CACHE", "/var/cache/aenv"))
MANIFEST = CACHE / "images" / "default" / "manifest.json"


def require_vm_assets() -> dict[str, Any]:
    """The default image's manifest; fails the test when the image, its kernel or QEMU is
    missing."""
    if not MANIFEST.exists():
        pytest.fail(f"no guest image at {MANIFEST}: run `make kernel image` (or `make test`, "
                    f"which builds them)", pytrace=False)
    man: dict[str, Any] = json.loads(MANIFEST.read_text())
    if not man.get("kernel") or not Path(man["kernel"]["vmlinux"]).exists():
        pytest.fail("the image manifest names no built kernel: run `make kernel image`",
                    pytrace=False)
    if shutil.which("qemu-system-x86_64") is None:
        pytest.fail("qemu-system-x86_64 is not installed: run `make setup`", pytrace=False)
    return man
