"""`import_image` on this host, no VM (host/runtime/imports.py, hostimport.py): a real block
server and repository, the confined helper applying each layer (the first streamed into
mke2fs, the next through fuse2fs, gzip inflated by igzip), and each layer sealed while the
next one is applied. The image's filesystem is read back from the block layers with
debugfs: the layers are stacked in their order whatever order their seals ended in. A layer
that fails leaves the layers sealed before it cached, and nothing of the import behind."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from host.contract import BuildFailed
from host.images import Image, ImageConfig, Layer
from host.images.layout import chain_ids
from host.runtime import hostimport
from host.runtime.imports import builder_layers, import_image
from host.runtime.manifests import ManifestStore
from host.storage import BlockServer
from host.storage.convert import convert_image
from host.storage.repository import PosixFsRepository
from tests.images.ocibuild import LayerTar, compress

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and uid maps need root")

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OURS = {"usr/sbin/aenv-init": b"#!init\n", "usr/bin/envd": b"#!envd\n"}


def _image(tmp: Path, name: str, tars: list[bytes], *, cut_last: bool = False) -> Image:
    """An image of gzip layers (`cut_last`: the last blob's gzip cut in half, its digest
    that of the cut blob, as a registry serving it whole would never give)."""
    chains = chain_ids(["sha256:" + hashlib.sha256(t).hexdigest() for t in tars])
    layers = []
    for i, tar in enumerate(tars):
        blob = compress(tar, "gzip")
        if cut_last and i == len(tars) - 1:
            blob = blob[:len(blob) // 2]
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        path = tmp / "blobs" / digest.split(":")[1]
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(blob)
        layers.append(Layer(digest, GZIP, "gzip", len(blob),
                            "sha256:" + hashlib.sha256(tar).hexdigest(), chains[i], path))
    return Image(name, name, name, "sha256:" + "1" * 64, None, "sha256:" + "2" * 64,
                 "sha256:" + "3" * 64, "linux", "amd64", ImageConfig(), tuple(layers), tmp)


def _built_in(tmp: Path) -> Any:
    """What the importer takes of the built-in image: its rootfs (our init and envd)."""
    tree = tmp / "builtin"
    for rel, data in OURS.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
        (tree / rel).chmod(0o755)
    rootfs = tmp / "builtin.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(rootfs), "16M"], check=True)
    return SimpleNamespace(rootfs=rootfs, manifest={"rootfs": {"digest": "sha256:builtin"}},
                           cmdline="console=ttyS0")


def _cat(raw: Path, path: str) -> bytes | None:
    p = subprocess.run(["debugfs", "-R", f"cat {path}", str(raw)], capture_output=True,
                       check=False)
    return None if b"File not found" in p.stderr else p.stdout


def _fsck_clean(raw: Path) -> bool:
    return subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True,
                          check=False).returncode == 0


async def test_layers_sealed_beside_the_next_apply_stack_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each import's first seal made slow: the next one's, started later, must still go
    # above it
    calls: list[Path] = []

    def convert(src: Path, dest: Path, **kw: Any) -> Any:
        calls.append(src)
        if len(calls) == 1:
            time.sleep(1.0)
        return convert_image(src, dest, **kw)

    monkeypatch.setattr(hostimport, "convert_image", convert)
    repo = tmp_path / "repo"
    bs = BlockServer(socket_dir=tmp_path / "s", state_dir=tmp_path / "st",
                     repository=PosixFsRepository(repo))
    await bs.start()
    try:
        parts: Any = SimpleNamespace(
            manifests=ManifestStore(f"posix_fs:{repo}"), block=SimpleNamespace(client=bs),
            blank_lock=asyncio.Lock(),
            config=SimpleNamespace(state_dir=tmp_path / "state"))
        parts.config.state_dir.mkdir()
        base = _built_in(tmp_path)
        big = os.urandom(3 << 20)  # a seal that takes a while beside the next apply
        tars = [LayerTar().dir("srv").file("srv/a", b"one\n").file("srv/gone", b"x")
                # the builder's mark, which only the host's builder disk may hold
                .dir("etc").dir("etc/aenv").file("etc/aenv/builder", b"").bytes(),
                LayerTar().dir("srv").file("srv/a", b"two\n").file("srv/b", big).bytes(),
                LayerTar().dir("srv").whiteout("srv/gone").file("srv/c", b"three\n").bytes()]
        logs: list[str] = []

        def log(_level: str, message: str, _step: str | None) -> None:
            logs.append(message)

        # the third layer's gzip cut short: the two below it are cached all the same
        with pytest.raises(BuildFailed, match="gzip stream is corrupt: igzip"):
            await import_image(parts, _image(tmp_path, "cut", tars, cut_last=True), base, log,
                               name="imp1")
        assert not list(parts.config.state_dir.glob(".import-*"))
        assert not [s.name for s in await bs.list()]  # no stack of the import left

        logs.clear()
        calls.clear()
        got = await import_image(parts, _image(tmp_path, "whole", tars), base, log,
                                 name="imp2")
        assert any("1 of 3 layers to apply" in m for m in logs), logs
        assert any("inflated by igzip" in m for m in logs), logs
        assert len(got.layers) == 5  # blank, the three layers, our files
        assert not list(parts.config.state_dir.glob(".import-*"))

        await bs.create("check", list(got.layers))
        raw = tmp_path / "check.raw"
        await bs.export_raw("check", str(raw))
        assert _cat(raw, "/srv/a") == b"two\n"  # the second layer over the first
        assert _cat(raw, "/srv/b") == big
        assert _cat(raw, "/srv/c") == b"three\n"
        assert _cat(raw, "/srv/gone") is None  # the third layer's whiteout
        assert _cat(raw, "/usr/bin/envd") == b"#!envd\n"  # our files on top of them all
        assert _cat(raw, "/etc/aenv/builder") is None  # an image's never boots a builder
        assert _fsck_clean(raw)

        # the builder's disk (builder.py): the blank, our files and the mark; made once
        disk = await builder_layers(parts, base, log, name="bld")
        assert await builder_layers(parts, base, log, name="bld") == disk
        await bs.create("bcheck", list(disk))
        braw = tmp_path / "builder.raw"
        await bs.export_raw("bcheck", str(braw))
        assert _cat(braw, "/etc/aenv/builder") == b""
        assert _cat(braw, "/usr/sbin/aenv-init") == b"#!init\n"
    finally:
        await bs.aclose()
