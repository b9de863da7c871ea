"""Fixtures for the VM tests: the built kernel + image, per-VM writable disk copies.

`guest_image` builds the kernel and image with `make kernel image` when they are missing
(both are cached by their inputs, so this is a no-op once built); set AENV_NO_BUILD=1 to
skip the VM tests instead of building.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from host.vmm import FileDisk
from host.vmm.image import GuestImage, ImageNotFound, build, find_image

from .fakefc import fake_fc, spec  # noqa: F401 - the Firecracker tests' fixtures


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    """The built guest image (kernel included); skips when it cannot be had."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 not installed")
    try:
        return find_image()
    except ImageNotFound as missing:
        if os.environ.get("AENV_NO_BUILD"):
            pytest.skip(f"{missing} and AENV_NO_BUILD is set")
    build(("kernel", "image"))
    return find_image()


def private_root(image: GuestImage, dest_dir: Path) -> FileDisk:
    """A writable root disk for one VM (qcow2 overlay), so no VM writes into the cache."""
    return image.overlay(dest_dir / "root.qcow2")
