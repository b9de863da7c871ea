"""OCI images as block layers: each OCI layer applied onto an ext4 disk inside an importer
VM and sealed as one block layer, cached under the layer's OCI chain id, then our init and
envd as the last layer; the image needs neither of its own (busybox works).

    blank ext4 (one per repository: `ociblank-<MiB>`)
    -> per OCI layer, bottom first: key = sha256(blank layer, chain id) -> `ocilayer-<key>`
       (images sharing base layers share these block layers, cache and repository objects)
    -> init + envd + user `user`: key = sha256(top key, the built-in image's envd layer)

The importer VM is our built-in image (python3, tar) with the target disk as /dev/vdb; it
applies a layer with `host/images/apply.py` (whiteouts, opaque dirs, hard links, xattrs),
unmounts, and the vCPUs stop while the block server seals the layer. Block layers depend
on the filesystem below them, so the chain id (not the layer digest alone) is the key.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Self

import zstandard

from host.contract import BuildFailed, BuildLog, GuestDefaults
from host.images import APPLY_SCRIPT as APPLY
from host.images import Image
from host.network import NetworkPolicy
from host.storage.convert import convert_image
from host.vmm.driver import Vm
from host.vmm.image import GuestImage

from .buildcache import read_entry, write_entry
from .guest_shell import GuestCommandError, GuestShell
from .layers import image_layers
from .parts import NodeParts

BLANK_MIB = 4096
INIT = "/usr/sbin/aenv-init"
EXEC_HELPER = "/usr/sbin/aenv-exec"  # envd's credential switch: a name of aenv-init
_MNT = "/mnt/aenv-target"


@dataclasses.dataclass(frozen=True)
class Imported:
    layers: tuple[str, ...]
    guest: GuestDefaults
    cmdline: str          # the built-in image's, booting our init


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


async def blank_layer(p: NodeParts) -> str:
    """The empty ext4 every imported image starts from (made once per repository)."""
    name = f"ociblank-{BLANK_MIB}"
    if (doc := await p.manifests.get_doc(name)) is not None:  # kept for good: no cache
        return str(doc["layer"])
    with tempfile.TemporaryDirectory(dir=p.config.state_dir, prefix=".blank-") as tmp:
        img = Path(tmp) / "blank.ext4"
        proc = await asyncio.create_subprocess_exec(
            "mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-m", "0", "-b", "4096", "-I", "256",
            "-E", "lazy_itable_init=0,lazy_journal_init=0", str(img), f"{BLANK_MIB}M",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise BuildFailed(f"mkfs.ext4 failed: {err.decode(errors='replace')}", step="base")
        dest = Path(tmp) / "blank.lsmt"
        await asyncio.to_thread(convert_image, img, dest)
        digest = await p.block.client.import_layer(dest, upload=True)
    await p.manifests.put_doc(name, {"layer": digest})
    return str(digest)


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


async def import_image(p: NodeParts, image: Image, base: GuestImage, log: BuildLog, *,
                       name: str) -> Imported:
    """Block layers for `image` (imported, or found in the repository). `name` prefixes
    the importer VM's stacks and network (the build's name, so recovery knows them)."""
    blank = await blank_layer(p)
    keys = [_key(blank, layer.chain_id) for layer in image.layers]
    envd_id = str(base.manifest.get("rootfs", {}).get("digest") or base.rootfs)
    final_key = _key(keys[-1] if keys else blank, "aenv-envd-init", envd_id)
    cmdline = f"{base.cmdline} init={INIT}"
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
    async with _Importer(p, base, layers, log, name=name) as imp:
        for i in range(first, len(image.layers)):
            layer = image.layers[i]
            log("info", f"applying layer {i + 1}/{len(image.layers)} {layer.digest[:19]} "
                f"({layer.size} bytes)", "base")
            layers = await imp.apply(layer.path, layer.compression, layer.diff_id)
            await write_entry(p.manifests, f"ocilayer-{keys[i]}", {"layers": list(layers),
                                                  "chain_id": layer.chain_id})
        layers = await imp.finish_rootfs(guest)
    await write_entry(p.manifests, f"ocilayer-{final_key}", {"layers": list(layers), "image": image.name})
    return Imported(layers, guest, cmdline)


class _Importer:
    """A VM of the built-in image with the target disk attached (/dev/vdb)."""

    def __init__(self, p: NodeParts, base: GuestImage, layers: tuple[str, ...],
                 log: BuildLog, *, name: str) -> None:
        self.p, self.base, self.layers, self.log = p, base, layers, log
        self.name = f"{name}-i"
        self.target = f"{name}-t"
        self.vm: Vm | None = None
        self.shell: GuestShell | None = None
        self.tmp = Path(tempfile.mkdtemp(dir=p.config.state_dir, prefix=".import-"))

    async def __aenter__(self) -> Self:
        p, mx = self.p, self.p.machines
        try:
            root = await image_layers(self.base, p.block.client,
                                      p.config.state_dir / "layers.json")
            net, (network, host, port, _fwd) = await mx.make_net(self.name, NetworkPolicy(
                allow_internet_access=False))
            cmdline = self.base.cmdline + (f" {net.kernel_cmdline()}" if net else "")
            await p.block.client.create(self.name, root)
            await p.block.client.create(self.target, list(self.layers))
            m = {"kernel": str(self.base.kernel.vmlinux), "cmdline": cmdline,
                 "machine": {"cpu_count": 1, "memory_mb": 512}}
            spec = mx.spec(m, name=self.name, memory=None, stack=self.name, network=network,
                           extra_stacks=(self.target,))
            self.vm, _ = await mx.boot(spec, timeout_s=p.config.boot_timeout_s)
            self.shell = GuestShell(host, port)
            await self.shell.upload(APPLY, "/var/tmp/aenv-apply.py")
            await self._root(f"mkdir -p {_MNT} && mount /dev/vdb {_MNT}")
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        mx = self.p.machines
        if self.shell is not None:
            await self.shell.aclose()
        if self.vm is not None:
            await mx.release_vm(self.vm)
        for stack in (self.name, self.target):
            with contextlib.suppress(Exception):
                await mx.drop_stack(stack)
        await mx.drop_net(self.name)
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def _root(self, script: str) -> None:
        assert self.shell is not None
        # the last lines only: the guest may print without end (each line is bounded)
        out: collections.deque[str] = collections.deque(maxlen=20)
        try:
            code = await self.shell.run(script, user="root",
                                        on_output=lambda _s, line: out.append(line))
        except GuestCommandError as exc:
            raise BuildFailed(f"image import: {exc}", step="base") from exc
        for line in out:
            self.log("info", line, "base")
        if code != 0:
            raise BuildFailed(f"image import failed (exit code {code}): "
                              f"{' | '.join(list(out)[-3:])}", step="base")

    async def _seal(self) -> tuple[str, ...]:
        """Unmount (a clean filesystem in every layer), seal with the vCPUs stopped,
        mount again."""
        assert self.vm is not None
        await self._root(f"sync && umount {_MNT}")
        await self.vm.pause()
        try:
            await self.p.block.client.seal(self.target, upload=True)
        finally:
            await self.vm.resume()
        await self._root(f"mount /dev/vdb {_MNT}")
        return tuple((await self.p.block.client.info(self.target)).layers)

    async def apply(self, blob: Path, compression: str, diff_id: str) -> tuple[str, ...]:
        assert self.shell is not None
        src = blob
        if compression == "zstd":  # the guest's python has no zstd: decompress here
            src = self.tmp / "layer.tar"
            await asyncio.to_thread(_unzstd, blob, src)
        await self.shell.upload(src, "/var/tmp/aenv-layer")
        if src != blob:
            src.unlink(missing_ok=True)
        # exit 3 (diff id mismatch) comes after the layer was applied: any failure
        # raises here, before the seal, and the target stack is discarded
        await self._root(f"python3 /var/tmp/aenv-apply.py --diff-id {diff_id} "
                         f"/var/tmp/aenv-layer {_MNT} && rm -f /var/tmp/aenv-layer")
        return await self._seal()

    async def finish_rootfs(self, guest: GuestDefaults) -> tuple[str, ...]:
        """Our init and envd, the mount points they need, user `user` (uid 1000) and the
        image's working directory (Docker creates it when missing)."""
        t = _MNT
        workdir = shlex.quote(t + guest.workdir)
        await self._root("\n".join([
            "set -e",
            (f"mkdir -p {t}/usr/sbin {t}/usr/bin {t}/etc/aenv {t}/proc {t}/sys {t}/dev "
            f"{t}/run {t}/tmp {t}/home {t}/root"),
            f"chmod 1777 {t}/tmp",
            f"cp -a {INIT} {t}{INIT}",
            f"ln -sfn aenv-init {t}{EXEC_HELPER}",
            f"rm -f {t}/usr/bin/envd && cp -a /usr/bin/envd {t}/usr/bin/envd",
            f"cp -a /etc/aenv/release {t}/etc/aenv/release 2>/dev/null || true",
            f"[ -e {t}/etc/passwd ] || echo 'root:x:0:0:root:/root:/bin/sh' > {t}/etc/passwd",
            f"[ -e {t}/etc/group ] || echo 'root:x:0:' > {t}/etc/group",
            (f"grep -q '^user:' {t}/etc/passwd || "
            f"echo 'user:x:1000:1000:user:/home/user:/bin/sh' >> {t}/etc/passwd"),
            f"grep -q '^user:' {t}/etc/group || echo 'user:x:1000:' >> {t}/etc/group",
            f"mkdir -p {t}/home/user && chown 1000:1000 {t}/home/user",
            f"[ -d {workdir} ] || {{ mkdir -p {workdir} && chown 1000:1000 {workdir}; }}",
        ]))
        return await self._seal()


def _unzstd(src: Path, dest: Path) -> None:
    with src.open("rb") as f, dest.open("wb") as out:
        zstandard.ZstdDecompressor().copy_stream(f, out)
