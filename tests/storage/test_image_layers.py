"""host.runtime.layers: image -> LSMT layers through a real block server, cached per state
dir by image digest; a node pointed at another repository uploads the cached layers there
too (the cache says "converted", not "in this repository")."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from host.runtime.layers import image_layers
from host.storage.control import BlockServerClient
from host.storage.repository import PosixFsRepository
from host.vmm.image import GuestImage, GuestKernel

from .conftest import BlockServerProc

MiB = 1 << 20


def _image(tmp_path: Path) -> GuestImage:
    rootfs = tmp_path / "rootfs.ext4"
    with open(rootfs, "wb") as f:  # contents do not matter to the conversion
        f.write(os.urandom(MiB))
        f.truncate(4 * MiB)
    kernel = GuestKernel(dir=tmp_path, vmlinux=tmp_path / "vmlinux", bzimage=None, release="x")
    return GuestImage(name="t", dir=tmp_path, manifest={"rootfs": {"digest": "sha256:img"}},
                      kernel=kernel, rootfs=rootfs, cmdline="console=ttyS0")


def test_cached_layers_reach_a_new_repository(tmp_path: Path) -> None:
    image = _image(tmp_path)
    cache = tmp_path / "layers.json"
    bs = BlockServerProc(tmp_path / "bs", repo=f"posix_fs:{tmp_path / 'repo1'}")
    bs.root.mkdir()

    async def layers() -> list[str]:
        return await image_layers(image, BlockServerClient(bs.socket_dir / "control.sock"),
                                  cache)

    bs.start()
    try:
        first = asyncio.run(layers())
        assert PosixFsRepository(tmp_path / "repo1").has_layer(first[0])
        # same state dir (and layers.json), another repository
        bs.stop()
        bs.repo = f"posix_fs:{tmp_path / 'repo2'}"
        bs.start()
        assert asyncio.run(layers()) == first  # from the cache: not converted again
        assert PosixFsRepository(tmp_path / "repo2").has_layer(first[0])
    finally:
        bs.stop()
