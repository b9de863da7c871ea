"""`HostImporter`: OCI layers onto an imported image's ext4 on the host, no VM (issue 31).

    the stack's layers (blank + the cached prefix) -> one sparse raw file (block server)
    per OCI layer: copy the raw (sparse), apply the layer into the copy with the confined
    helper (host/images/confined.py: fuse2fs + apply.py in a user namespace of its own),
    and the blocks where the copy differs from the raw before become the layer's block
    layer (host/storage/convert.py with a base: changed blocks, zeroed blocks as zeroes),
    sealed in a thread while the next layer is applied (the helper is a process)
    -> our init and envd the same way (the helper's `finish`)

The first layer of an image (only the blank below it) is `populate`d instead: with
e2fsprogs 1.47.1+ streamed into `mke2fs -d -` (the blank's options, MKFS_OPTIONS), which
reads the tar itself, while the helper hashes it and checks every entry is one mke2fs makes
as apply.py would (host/images/streamed.py); a layer with one that is not (a whiteout, an
ACL, an entry under a symlink, ...) and older e2fsprogs: applied into a directory, then
`mke2fs -d` of that tree. Debian + python3 + git, 297 MiB: streamed ~2.8 s, tree ~5 s,
through fuse2fs ~18 s (measured with metadata checksums on; a layer above the first now
goes ~2.6x faster: /usr/share, 8,367 entries, 4.75 s -> 1.84 s, MKFS_OPTIONS and apply.py
saving fuse2fs round trips).

Each block layer reads as the ext4 the layers below left, changed by this layer (the
first: a new ext4 of the same geometry), so the cache keys of imports.py are unchanged. Why not a
VM: under TCG the guest's Python applied a 300 MB layer in ~63 s plus a 12 s boot;
why fuse2fs and not the host kernel's ext4: the image is written by a userspace library
in a process that holds no privilege, so nothing in it reaches the host kernel's
filesystem code; why not `mke2fs -d` for every layer (faster): it makes a whole new
filesystem, so layers shared by many images would stop sharing their blocks; the first
layer's filesystem is new anyway, and the layers above apply onto it as onto any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any, Self

from host.contract import BuildFailed, BuildLog, GuestDefaults
from host.images import Layer, open_layer
from host.images.layertar import GZIP_MAGIC
from host.storage.convert import convert_image
from host.vmm.image import GuestImage

from .importhelper import UID_BASE, ConfinedHelper
from .parts import NodeParts

_OUR_FILES = ("usr/sbin/aenv-init", "usr/bin/envd", "etc/aenv/release")
BUILDER_MARK = "etc/aenv/builder"  # rootfs/init/init.c: a root with it boots a builder


Sealed = Callable[[tuple[str, ...]], Awaitable[None]]


class HostImporter:
    """Layers applied on this host onto raw copies of the target's filesystem, one raw
    per layer; each layer's seal (its changed blocks found and stored) runs beside the
    next layer's apply, in a thread, while the helper (a process) applies: the two
    cores both work (the bench's image: its 1.0 s seal beside our files' 0.6 s)."""

    def __init__(self, p: NodeParts, base: GuestImage, layers: tuple[str, ...],
                 log: BuildLog, *, name: str) -> None:
        self.p, self.base, self.layers, self.log = p, base, layers, log
        self.name = f"{name}-t"
        self.helper = ConfinedHelper()  # first: it refuses a host that lacks its tools
        self.tmp = Path(tempfile.mkdtemp(dir=p.config.state_dir, prefix=".import-"))
        self.raws = 0
        self.below = self._new_raw()  # the filesystem the next layer applies onto
        self.over_blank = len(layers) == 1  # only the blank below: `populate` a new ext4
        self.made = (self.below, self.below)  # (below, new raw) of the last step
        self.sealing: asyncio.Task[None] | None = None  # the last step's seal

    def _new_raw(self) -> Path:
        self.raws += 1
        return self.tmp / f"{self.raws}.raw"

    async def __aenter__(self) -> Self:
        client = self.p.block.client
        try:
            await client.create(self.name, list(self.layers))
            try:
                await client.export_raw(self.name, str(self.below))
            finally:
                await client.delete(self.name)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.sealing is not None:  # never left running over the files it reads
                with contextlib.suppress(Exception):
                    await self.sealing
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.helper.close()

    async def apply(self, layer: Layer, sealed: Sealed | None = None) -> None:
        """Apply OCI `layer`; its block layer goes on top of `layers` when sealed (beside
        the next apply), then `sealed(layers)` is awaited."""
        def feed(stdin: IO[bytes]) -> None:
            with open_layer(layer) as plain:  # zstd decompressed, the digest checked
                shutil.copyfileobj(plain, stdin, 1 << 20)

        # a gzip layer is inflated in the helper by igzip, beside its reading (gunzip.py)
        args = ["--diff-id", layer.diff_id, *(["--gzip"] if _gzipped(layer) else [])]
        if not self.over_blank:
            summary = await self._step(["apply", *args], feed)
        else:  # only the blank below: a new ext4 of the layer
            summary = await self._step(args, feed, first=True)
            if why := summary.get("not_streamed"):
                self.log("info", f"layer {layer.digest[:19]} went through a tree: {why}",
                         "base")
        if summary.get("warnings_total"):
            for w in summary.get("warnings", [])[:10]:
                self.log("warn", f"layer {layer.digest[:19]}: {w}", "base")
        self.over_blank = False
        await self._seal_after(sealed)

    async def finish_rootfs(self, guest: GuestDefaults, *, builder: bool = False
                            ) -> tuple[str, ...]:
        """Our init and envd (from the built-in image), the mount points they need, user
        `user` (uid 1000) and the image's working directory; the layers, all sealed.
        `builder`: the mark that makes our init boot a builder (builder.py)."""
        staged = await asyncio.to_thread(self._our_files, builder)

        def feed(stdin: IO[bytes]) -> None:
            stdin.write(staged)

        await self._step(["finish", "--workdir", guest.workdir], feed)
        await self._seal_after(None)
        await self._sealed()
        return self.layers

    def _our_files(self, builder: bool) -> bytes:
        """A tar of init, envd and the release file, dumped from the built-in rootfs (and
        the builder's mark)."""
        out = self.tmp / "ours"
        out.mkdir(exist_ok=True)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for rel in _OUR_FILES:
                dest = out / rel.replace("/", "_")
                r = subprocess.run(["debugfs", "-R", f"dump -p /{rel} {dest}",
                                    str(self.base.rootfs)], capture_output=True, check=False)
                if not dest.is_file() or not dest.stat().st_size:
                    if rel.startswith("etc/"):
                        continue  # optional
                    raise BuildFailed(f"image import: /{rel} is not in the built-in image "
                                      f"({r.stderr.decode(errors='replace')[-200:]})",
                                      step="base")
                tar.add(dest, arcname=rel)
            if builder:
                tar.addfile(tarfile.TarInfo(BUILDER_MARK))
        shutil.rmtree(out, ignore_errors=True)
        return buf.getvalue()

    async def _step(self, args: list[str], feed: Callable[[IO[bytes]], None], *,
                    first: bool = False) -> dict[str, Any]:
        """The helper's `args` on a new raw: a copy of the one below (`first`: `populate`
        with options `args` on a blank file of its size); it is below the next step."""
        t = time.perf_counter()
        below, cur = self.below, self._new_raw()
        if not first:
            await asyncio.to_thread(_sparse_copy, below, cur)
            summary = await asyncio.to_thread(self.helper.run, cur, args, feed)
        else:
            summary = await asyncio.to_thread(self.helper.populate, cur,
                                              below.stat().st_size, self.tmp / "tree",
                                              args, feed)
        self.below, self.made = cur, (below, cur)
        mib = summary.get("tar_bytes", 0) / 2**20
        secs = time.perf_counter() - t
        if mib:
            way = ("through fuse2fs" if not first else "a new ext4 by mke2fs -d of the tar"
                   if summary.get("streamed") else "a new ext4 by mke2fs -d of a tree")
            inflated = ", inflated by igzip" if summary.get("inflated_by") else ""
            self.log("info", f"applied {mib:.0f} MiB in {secs:.1f}s ({mib / secs:.0f} MiB/s, "
                     f"{summary.get('entries', 0)} entries, {way}{inflated})", "base")
        return summary

    async def _seal_after(self, sealed: Sealed | None) -> None:
        """The step just made (the raw below the next) is sealed in a task of its own,
        once the seal before it is done (layers go on top in order)."""
        await self._sealed()
        self.sealing = asyncio.create_task(self._seal(*self.made, sealed))

    async def _sealed(self) -> None:
        task, self.sealing = self.sealing, None
        if task is not None:
            await task

    async def _seal(self, below: Path, cur: Path, sealed: Sealed | None) -> None:
        """The blocks where `cur` differs from `below` (the raw before it): a block layer on
        top of the stack's; `below` is no longer needed then."""
        out = cur.with_suffix(".lsmt")
        t = time.perf_counter()
        await asyncio.to_thread(convert_image, cur, out, base=below)
        t1 = time.perf_counter()
        mib = out.stat().st_size / 2**20
        digest = await self.p.block.client.import_layer(out, upload=True)
        out.unlink(missing_ok=True)
        below.unlink(missing_ok=True)
        self.log("info", f"block layer {digest[:19]}: {mib:.0f} MiB, the changed blocks in "
                 f"{t1 - t:.1f}s, stored in {time.perf_counter() - t1:.1f}s", "base")
        self.layers = (*self.layers, digest)
        if sealed is not None:
            await sealed(self.layers)


def sweep(state_dir: Path) -> None:
    """Remove the work dirs of imports that did not end (a crash): none runs yet."""
    for d in (*state_dir.glob(".import-*"), *state_dir.glob(".blank-*")):
        shutil.rmtree(d, ignore_errors=True)


def _gzipped(layer: Layer) -> bool:
    """Whether the helper gets gzip (zstd is inflated here; a media type may say gzip of a
    plain tar, as layertar's `open_layer` allows)."""
    if layer.compression == "zstd":
        return False
    with open(layer.path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def _sparse_copy(src: Path, dest: Path) -> None:
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dest)],
                   check=True)
    os.chown(dest, UID_BASE, UID_BASE)  # fuse2fs (the helper's uid) opens it by fd only
