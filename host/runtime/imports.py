"""OCI images as block layers: each OCI layer applied onto an ext4 disk on this host (no
VM: hostimport.py) and turned into one block layer, cached under the layer's OCI chain id,
then our init and envd as the last layer; the image needs neither of its own (busybox
works).

    blank ext4 (one per repository and mkfs options: `ociblank-<MiB>-<options hash>`)
    -> per OCI layer, bottom first: key = sha256(blank layer, chain id) -> `ocilayer-<key>`
       (images sharing base layers share these block layers, cache and repository objects)
    -> init + envd + user `user`: key = sha256(top key, the built-in image's envd layer)

A layer is applied by `host/images/apply.py` (whiteouts, opaque dirs, hard links, xattrs)
in a confined helper (user namespace, fuse2fs). Block layers depend on the filesystem below
them, so the chain id (not the layer digest alone) is the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import tempfile
from pathlib import Path

from host.contract import BuildFailed, BuildLog, BuildSpec, GuestDefaults
from host.images import Image
from host.storage.convert import convert_image
from host.vmm.image import GuestImage

from .buildcache import read_entry, write_entry
from .hostimport import HostImporter
from .importhelper import MKFS_OPTIONS
from .parts import NodeParts

BLANK_MIB = 4096
INIT = "/usr/sbin/aenv-init"
# What the SDKs send as `fromImage` when no source was chosen (`Template()` alone, or
# `from_base_image()`): E2B's base image, whose role our built-in image plays.
E2B_BASE_IMAGES = ("e2bdev/base", "docker.io/e2bdev/base")


@dataclasses.dataclass(frozen=True)
class Imported:
    layers: tuple[str, ...]
    guest: GuestDefaults
    cmdline: str          # the built-in image's, booting our init


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


async def blank_layer(p: NodeParts) -> str:
    """The empty ext4 every imported image starts from (made once per repository)."""
    # the options in the name: a blank made with others is not this one (nor are the
    # layers keyed on it)
    name = f"ociblank-{BLANK_MIB}-{_key(*MKFS_OPTIONS)[:12]}"
    async with p.blank_lock:  # a build's import and its builder's disk may both want it
        if (doc := await p.manifests.get_doc(name)) is not None:  # kept for good: no cache
            return str(doc["layer"])
        return await _make_blank(p, name)


async def _make_blank(p: NodeParts, name: str) -> str:
    with tempfile.TemporaryDirectory(dir=p.config.state_dir, prefix=".blank-") as tmp:
        img = Path(tmp) / "blank.ext4"
        proc = await asyncio.create_subprocess_exec(
            "mkfs.ext4", "-q", "-F", *MKFS_OPTIONS, str(img), f"{BLANK_MIB}M",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise BuildFailed(f"mkfs.ext4 failed: {err.decode(errors='replace')}", step="base")
        dest = Path(tmp) / "blank.lsmt"
        await asyncio.to_thread(convert_image, img, dest)
        digest = await p.block.client.import_layer(dest, upload=True)
    await p.manifests.put_doc(name, {"layer": digest})
    # a blank made with other options (older code) is no base of new imports: its document
    # goes, so its layer stays only while something made on it does (collect.py)
    for other in await p.manifests.documents("ociblank-"):
        if other != name:
            await p.manifests.delete_doc(other)
    return str(digest)


def ours_id(base: GuestImage) -> str:
    """What identifies our init and envd: the built-in image's rootfs (its digest)."""
    return str(base.manifest.get("rootfs", {}).get("digest") or base.rootfs)


def imported_cmdline(base: GuestImage) -> str:
    """An imported image's kernel command line: the built-in image's, booting our init."""
    return f"{base.cmdline} init={INIT}"


def image_to_import(spec: BuildSpec) -> str | None:
    """The OCI image a build imports: its `fromImage`, unless none or E2B's base image."""
    if spec.from_image and spec.from_image.split(":")[0] not in E2B_BASE_IMAGES:
        return spec.from_image
    return None


def guest_defaults(image: Image) -> GuestDefaults:
    """The image config's ENV, WORKDIR and USER (E2B's `user` and its home otherwise)."""
    cfg = image.config
    user = cfg.user.split(":", 1)[0]
    if user in ("", "0", "root", "1000"):  # root: E2B runs as `user`; uid 1000 is `user`
        user = "user"
    elif user.isdigit():
        user = "root"  # envd switches users by name; a bare uid has none in the image
    return GuestDefaults(user=user, workdir=cfg.working_dir or "/home/user",
                         env=cfg.env_map())


async def builder_layers(p: NodeParts, base: GuestImage, log: BuildLog, *,
                         name: str) -> tuple[str, ...]:
    """The disk a builder boots from (builder.py): the blank, our init and envd, and the
    mark that makes init boot a builder; made once (cached as an image import is)."""
    blank = await blank_layer(p)
    envd_id = ours_id(base)
    key = _key(blank, "aenv-builder", envd_id)
    if (doc := await read_entry(p.manifests, f"ocilayer-{key}")) is not None:
        return tuple(doc["layers"])
    async with HostImporter(p, base, (blank,), log, name=name) as imp:
        layers = await imp.finish_rootfs(GuestDefaults(), builder=True)
    await write_entry(p.manifests, f"ocilayer-{key}", {"layers": list(layers),
                                                       "image": "aenv-builder"})
    return layers


async def import_image(p: NodeParts, image: Image, base: GuestImage, log: BuildLog, *,
                       name: str) -> Imported:
    """Block layers for `image` (imported, or found in the repository). `name` prefixes
    the import's stack (the build's name, so recovery knows it)."""
    blank = await blank_layer(p)
    keys = [_key(blank, layer.chain_id) for layer in image.layers]
    envd_id = ours_id(base)
    final_key = _key(keys[-1] if keys else blank, "aenv-envd-init", envd_id)
    cmdline = imported_cmdline(base)
    guest = guest_defaults(image)
    if (doc := await read_entry(p.manifests, f"ocilayer-{final_key}")) is not None:
        log("info", f"CACHED image {image.name} ({len(image.layers)} layers)", "base")
        return Imported(tuple(doc["layers"]), guest, cmdline)
    layers: tuple[str, ...] = (blank,)
    first = 0
    for i, key in enumerate(keys):
        if (doc := await read_entry(p.manifests, f"ocilayer-{key}")) is None:
            break
        layers, first = tuple(doc["layers"]), i + 1
    log("info", f"importing {image.name}: {len(image.layers) - first} of "
        f"{len(image.layers)} layers to apply", "base")
    async with HostImporter(p, base, layers, log, name=name) as imp:
        for i in range(first, len(image.layers)):
            layer = image.layers[i]
            log("info", f"applying layer {i + 1}/{len(image.layers)} {layer.digest[:19]} "
                f"({layer.size} bytes)", "base")

            async def sealed(layers: tuple[str, ...], key: str = keys[i],
                             chain_id: str = layer.chain_id) -> None:
                await write_entry(p.manifests, f"ocilayer-{key}",
                                  {"layers": list(layers), "chain_id": chain_id})
            await imp.apply(layer, sealed)  # sealed beside the next layer's apply
        layers = await imp.finish_rootfs(guest)
    await write_entry(p.manifests, f"ocilayer-{final_key}", {"layers": list(layers), "image": image.name})
    return Imported(layers, guest, cmdline)
