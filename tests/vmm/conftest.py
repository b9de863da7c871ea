"""Fixtures for the VM tests: the built kernel + image, per-VM writable disk copies.

`guest_image` builds the kernel and image with `make kernel image` when they are missing
(both are cached by their inputs, so this is a no-op once built); set AENV_NO_BUILD=1 to
skip the VM tests instead of building.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from host.vmm import FileDisk
from host.vmm.image import GuestImage, ImageNotFound, build, find_image


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


def private_disks(image: GuestImage, dest: Path) -> tuple[FileDisk, ...]:
    """The image's layers as disks, writable layers copied (sparse) into `dest` so a VM
    never writes into the shared cache."""
    disks = []
    for lay in image.layers:
        path = lay.path
        if not lay.read_only:
            path = dest / lay.path.name
            subprocess.run(["cp", "--sparse=always", str(lay.path), str(path)], check=True)
        disks.append(FileDisk(path=path, read_only=lay.read_only, format=lay.format,
                              serial=lay.name))
    return tuple(disks)
