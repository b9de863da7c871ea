"""Template builds: a source's layers, build steps in a VM, start + ready, snapshot.

    source layers (built-in image | an existing template | an OCI image)
    -> the longest prefix of steps found in the build cache (their layers, no VM work)
    -> a build VM on those layers, RAM in a share=on file: an image's restored from the
       node's builder (builder.py; made beside the import when missing), else cold-booted
    -> each remaining step through envd; a step that touched the disk is sealed as a layer
       (guest `sync`, vCPUs stopped for the seal) and cached under hash(parent, step)
    -> the start command in the background until the ready command exits 0
    -> freeze the memory base, seal the disk, commit the template manifest

Everything a failed build made is removed (VM, stack, network, memory dir); layers and
cache entries of the steps that succeeded stay: they are the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from host.contract import BuildFailed, BuildLog, BuildSpec, GuestDefaults, SnapshotRef
from host.images import ImageError, PullProgress, RegistryConfig, pull
from host.network import NetworkPolicy
from host.vmm.driver import Vm
from host.vmm.errors import VmmError
from host.vmm.image import find_image

from . import builddisk, rebuilds
from . import builder as builders
from . import steps as guest_steps
from .buildcache import BuildCache, CacheEntry, source_key, step_key
from .errors import NodeRuntimeError, SandboxStartError, SnapshotNotFoundError
from .guest_shell import GuestCommandError, GuestShell, OnOutput
from .imports import BLANK_MIB, image_to_import, import_image
from .layers import image_layers
from .manifests import VERSION
from .parts import NodeParts, build_stack

log_ = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
# the build VM's init grows its root filesystem to the device (rootfs/init/init.c)
GROWFS_FLAG = "aenv.growfs"
DEFAULT_READY_WITH_START = "sleep 20"  # E2B's default when a start command has none


def _noop(level: str, message: str, step: str | None) -> None:
    log_.debug("build %s [%s] %s", level, step, message)


async def build(p: NodeParts, spec: BuildSpec, log: BuildLog | None = None) -> SnapshotRef:
    if spec.snapshot_id in p.building:
        raise NodeRuntimeError(f"template {spec.snapshot_id} is already being built")
    p.building.add(spec.snapshot_id)
    try:
        return await _Build(p, spec, log or _noop).run()
    finally:
        p.building.discard(spec.snapshot_id)


@dataclasses.dataclass
class _Source:
    layers: tuple[str, ...]
    kernel: str
    cmdline: str          # without the per-namespace network part (added at boot)
    image: str
    guest: GuestDefaults
    start_cmd: str | None = None  # an image's ENTRYPOINT + CMD, if the build sets none


class _Build:
    def __init__(self, p: NodeParts, spec: BuildSpec, log: BuildLog) -> None:
        self.p, self.spec, self.log = p, spec, log
        self.stack = build_stack(spec.snapshot_id)
        self.mem_root = p.memory.dir / spec.snapshot_id
        self.vm: Vm | None = None
        self.net_made = False
        self.shell: GuestShell | None = None
        self.timings: dict[str, float] = {}
        self.cache = BuildCache(p.manifests)
        self.disk_mib = 0
        self.out_key = ""  # rebuilds.output_key of this build's inputs
        # the node's builder for this build's VM, found or made beside the image import
        self.builder = builders.BuilderUse(p, spec, self.stack, log)

    def _step_output(self, step_no: str) -> OnOutput:
        """What a step's command prints goes to the build log, under its step number."""
        def on_output(_stream: str, line: str) -> None:
            self.log("info", line, step_no)
        return on_output

    async def run(self) -> SnapshotRef:
        t0 = time.perf_counter()
        guest_steps.validate(self.spec.steps, self.spec.files_dir)
        try:
            await self.builder.start(self._stack_size(BLANK_MIB << 20))
            src = await self._source()
            self.timings["source_s"] = time.perf_counter() - t0
            layers, guest, first, keys = await self._cached_prefix(src)
            self.out_key = rebuilds.output_key(
                self.spec, keys[-1] if keys else source_key(src.layers, src.guest),
                kernel=src.kernel, cmdline=src.cmdline, image_start=src.start_cmd,
                network_mode=self.p.machines.mode)
            ref = None
            if first == len(self.spec.steps) and not self.spec.force:
                ref = await self._reuse(t0)
            if ref is None:
                ref = await self._build_in_vm(src, layers, guest, first, keys)
            self.timings["total_s"] = time.perf_counter() - t0
            return ref
        except BaseException:
            await self._cleanup()
            shutil.rmtree(self.mem_root, ignore_errors=True)
            raise
        finally:
            await self.builder.close()  # not used: a failure, a ready build reused
            if self.shell is not None:
                await self.shell.aclose()

    # -- source and cache -------------------------------------------------------------------

    async def _source(self) -> _Source:
        spec, p = self.spec, self.p
        if (reference := image_to_import(spec)) is not None:
            return await self._image_source(reference)
        if spec.from_snapshot:
            try:
                m = await p.manifests.get(spec.from_snapshot)
            except SnapshotNotFoundError as exc:
                raise BuildFailed(f"template {spec.from_snapshot} not found", step="base") \
                    from exc
            g = m.get("guest") or {}
            return _Source(tuple(m["disk"]["layers"]), m["kernel"],
                           m.get("base_cmdline", m["cmdline"]), m.get("image") or "",
                           GuestDefaults(user=g.get("user", "user"),
                                         workdir=g.get("workdir", "/home/user"),
                                         env=dict(g.get("env") or {})))
        image = await asyncio.to_thread(find_image, spec.machine.image, p.config.image_cache)
        layers = await image_layers(image, p.block.client, p.config.state_dir / "layers.json")
        return _Source(tuple(layers), str(image.kernel.vmlinux), image.cmdline, image.name,
                       GuestDefaults())

    async def _image_source(self, reference: str) -> _Source:
        """Pull the image and import its layers (or find them imported already)."""
        cfg = self.p.config
        reg = RegistryConfig(cache_dir=cfg.oci_cache_dir, mirror=cfg.registry_mirror,
                             insecure_registries=cfg.insecure_registries)
        self.log("info", f"Pulling {reference}", "base")

        def progress(pr: PullProgress) -> None:
            if pr.message:
                self.log("info", pr.message, "base")

        try:
            image = await pull(reference, reg, credentials=self.spec.registry,
                               progress=progress)
        except ImageError as exc:
            raise BuildFailed(f"pulling {reference}: {exc}", step="base") from exc
        base = await asyncio.to_thread(find_image, self.spec.machine.image, cfg.image_cache)
        imported = await import_image(self.p, image, base, self.log, name=self.stack)
        c = image.config
        start = shlex.join([*c.entrypoint, *c.cmd]) if (c.entrypoint or c.cmd) else None
        return _Source(imported.layers, str(base.kernel.vmlinux), imported.cmdline,
                       image.name, imported.guest, start)

    async def _cached_prefix(self, src: _Source
                             ) -> tuple[tuple[str, ...], GuestDefaults, int, list[str]]:
        """(layers, guest defaults, index of the first step to run, every step's key)."""
        keys, k = [], source_key(src.layers, src.guest)
        for step in self.spec.steps:
            k = step_key(k, step)
            keys.append(k)
        layers, guest, first = src.layers, src.guest, 0
        n = len(self.spec.steps)
        for i, step in enumerate(self.spec.steps):
            if self.spec.force or step.force:
                break
            entry = await self.cache.get(keys[i])
            if entry is None:
                break
            layers, guest, first = entry.layers, entry.guest, i + 1
            self.log("info", f"CACHED [{i + 1}/{n}] {guest_steps.describe(step)}", str(i + 1))
        return layers, guest, first, keys

    async def _reuse(self, t0: float) -> SnapshotRef | None:
        """Every input matches a ready build: commit it again, no VM (rebuilds.py)."""
        ready = await rebuilds.ready_build(self.p, self.out_key)
        if ready is None:
            return None
        self.timings["total_s"] = time.perf_counter() - t0
        ref = await rebuilds.reuse(self.p, self.spec, ready, self.timings)
        if ref is not None:
            # the newest build of these inputs: the old one may be deleted first
            await rebuilds.remember(self.p, self.out_key, self.spec.snapshot_id)
            self.log("info", f"Reusing ready build {ready['snapshot_id']}: every input is "
                     f"unchanged (no VM booted; skip_cache builds anew)", "finalize")
        return ref

    # -- the build VM ---------------------------------------------------------------------------

    async def _build_in_vm(self, src: _Source, layers: tuple[str, ...], guest: GuestDefaults,
                           first: int, keys: list[str]) -> SnapshotRef:
        p, spec, mx = self.p, self.spec, self.p.machines
        if self.mem_root.exists():
            shutil.rmtree(self.mem_root)
        self.mem_root.mkdir(parents=True)
        net, (network, host, port, _fwd) = await mx.make_net(self.stack, NetworkPolicy())
        self.net_made = True
        grow, size = await self._create_stack(layers)
        cmdline = (src.cmdline + (f" {net.kernel_cmdline()}" if net is not None else "")
                   ).strip()
        m: dict[str, Any] = {
            "version": VERSION, "kind": "template", "snapshot_id": spec.snapshot_id,
            "machine": dataclasses.asdict(spec.machine), "network_mode": mx.mode,
            "image": src.image, "kernel": src.kernel, "cmdline": cmdline,
            "base_cmdline": src.cmdline,
        }
        builder = await self.builder.take(m, size)
        scratch = self.mem_root / "scratch.mem"
        vspec = builders.builder_spec(p, m, name=self.stack, ram=scratch, network=network)
        t1 = time.perf_counter()
        self.shell = GuestShell(host, port)
        boot = None
        if builder is not None:
            self.log("info", "Restoring the build VM from the node's builder", "base")
            got = await self.builder.restore(builder, vspec, self.shell, grow=grow,
                                             on_output=self._step_output("base"))
            if got is not None:
                self.vm, boot = got
        if boot is None:
            if grow:  # our init grows it at boot (a restored builder: switch-root did)
                m["cmdline"] = f"{cmdline} {GROWFS_FLAG}"
                vspec = dataclasses.replace(vspec, cmdline=m["cmdline"])
            self.log("info", "Booting the build VM", "base")
            self.vm, boot = await mx.boot(vspec, timeout_s=p.config.boot_timeout_s)
        self.timings.update(boot)
        if grow:
            t = time.perf_counter()
            assert self.shell is not None
            await builddisk.grow_filesystem(self.shell, self.spec, self.log, self.disk_mib)
            self.timings["grow_s"] = time.perf_counter() - t
        n = len(spec.steps)
        for i in range(first, n):
            step = spec.steps[i]
            self.log("info", f"[{i + 1}/{n}] {guest_steps.describe(step)}", str(i + 1))
            t = time.perf_counter()
            touched_disk, guest = await guest_steps.execute(
                self.shell, step, guest, spec.files_dir, index=i + 1,
                on_output=self._step_output(str(i + 1)))
            if touched_disk:
                layers = await self._seal_step()
            await self.cache.put(keys[i], CacheEntry(tuple(layers), guest))
            self.timings[f"step{i + 1}_s"] = time.perf_counter() - t
        if self.shell is not None:
            await builddisk.check_free_disk(self.shell, self.spec, self.log)
        await self._start_and_wait(guest, src.start_cmd)
        return await self._commit(m, vspec, scratch, guest, first, t1, len(src.layers))

    def _stack_size(self, virtual_size: int) -> int:
        """The build's disk over a source of `virtual_size` bytes: the machine's disk size
        or enough to leave `min_free_disk_mb` free, whole MiB, never smaller."""
        spec = self.spec
        want = max(spec.machine.disk_mb << 20, virtual_size + (spec.min_free_disk_mb << 20))
        return max(virtual_size, -(-want // (1 << 20)) << 20)

    async def _create_stack(self, layers: tuple[str, ...]) -> tuple[bool, int]:
        """The build's disk: the source's layers, grown to `_stack_size` (unwritten blocks
        cost nothing). (Whether the device is bigger than the source's filesystem, its
        size.)"""
        client = self.p.block.client
        await self.p.machines.drop_stack(self.stack)
        info = await client.create(self.stack, list(layers))
        want = self._stack_size(info.virtual_size)
        if want <= info.virtual_size:
            return False, info.virtual_size
        await client.delete(self.stack)
        await client.create(self.stack, list(layers), virtual_size=want)
        self.disk_mib = want >> 20
        return True, want

    async def _seal_step(self) -> tuple[str, ...]:
        """The disk as this step left it becomes a layer: the guest flushes its page
        cache, the vCPUs stop (QEMU drains its I/O) while the upper is sealed."""
        assert self.shell is not None and self.vm is not None
        await self.shell.run("sync", user="root", timeout_s=120.0)
        await self.vm.pause()
        try:
            await self.p.block.client.seal(self.stack, upload=True)
        finally:
            await self.vm.resume()
        info = await self.p.block.client.info(self.stack)
        return tuple(info.layers)

    async def _start_and_wait(self, guest: GuestDefaults, image_start: str | None) -> None:
        spec = self.spec
        assert self.shell is not None
        ready = spec.ready_cmd or (DEFAULT_READY_WITH_START if spec.start_cmd else None)
        start = spec.start_cmd or image_start
        if start:
            self.log("info", f"Starting: {start}", "finalize")
            try:
                await self.shell.start(start, user=guest.user, env=guest.env,
                                       cwd=guest.workdir, tag="start_cmd")
            except GuestCommandError as exc:
                raise BuildFailed(f"the start command did not start: {exc}",
                                  step="finalize") from exc
        if ready:
            self.log("info", f"Waiting for the ready command: {ready}", "finalize")
            t = time.perf_counter()
            ok = await self.shell.wait_until(
                ready, user=guest.user, env=guest.env, cwd=guest.workdir,
                timeout_s=READY_TIMEOUT_S,
                on_fail=lambda code: self.log("debug", f"not ready yet (exit {code})",
                                              "finalize"))
            if not ok:
                raise BuildFailed(f"the ready command {ready!r} did not succeed within "
                                  f"{READY_TIMEOUT_S:g}s", step="finalize")
            self.timings["ready_s"] = time.perf_counter() - t
            self.log("info", "Ready", "finalize")

    async def _commit(self, m: dict[str, Any], vspec: Any, scratch: Path,
                      guest: GuestDefaults, first: int, t_boot: float,
                      source_layers: int) -> SnapshotRef:
        p, mx, spec = self.p, self.p.machines, self.spec
        assert self.vm is not None
        t = time.perf_counter()
        try:
            base = await self.vm.freeze_memory(self.mem_root / "base")
        except VmmError as exc:
            raise SandboxStartError(f"template {spec.snapshot_id}: freezing memory: "
                                    f"{exc}") from exc
        await p.block.client.seal(self.stack, upload=True)
        self.timings["freeze_s"] = time.perf_counter() - t
        self.timings["boot_to_frozen_s"] = time.perf_counter() - t_boot
        await mx.release_vm(self.vm)
        self.vm = None
        scratch.unlink(missing_ok=True)
        await self._merge_steps(source_layers)
        info = await p.block.client.info(self.stack)
        await self._cleanup()
        t3 = time.perf_counter()
        files = await p.memory.upload(base.dir)
        self.timings["upload_memory_s"] = time.perf_counter() - t3
        m.update({
            "created_at": time.time(), "parent_id": spec.from_snapshot,
            "config_sha256": mx.digest(vspec),
            "vmm": (await mx.identity()).to_json(),  # restores must run under the same
            "memory": {"base_dir": p.memory.rel(base.dir), "base_id": base.id,
                       "devstate": p.memory.rel(base.template_path), "snapshot_dir": None,
                       "files": list(files),
                       "sha256": {n: h for n, h in files.items() if h}},
            "disk": {"layers": list(info.layers), "virtual_size": info.virtual_size},
            "depends_on": [spec.snapshot_id],
            "guest": dataclasses.asdict(guest),
            "build": {"steps": len(spec.steps), "cached_steps": first,
                      "start_cmd": spec.start_cmd, "ready_cmd": spec.ready_cmd},
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
        })
        await p.manifests.put(spec.snapshot_id, m)  # the commit point
        await rebuilds.remember(p, self.out_key, spec.snapshot_id)
        p.last_timings = self.timings
        return SnapshotRef(spec.snapshot_id, spec.machine, m["created_at"], spec.from_snapshot,
                           m)

    async def _merge_steps(self, source_layers: int) -> None:
        """Past `max_disk_chain` layers of its own (one per step that wrote the disk, and
        the last seal), the template's are merged into one (compaction.py's bound, for
        templates): every sandbox started from it opens a bounded chain. The steps'
        layers stay while their build-cache entries name them."""
        client, bound = self.p.block.client, self.p.config.max_disk_chain
        info = await client.info(self.stack)
        if bound <= 0 or len(info.layers) - source_layers <= bound:
            return
        t = time.perf_counter()
        out = await client.compact(self.stack, source_layers)
        self.timings["merge_layers_s"] = time.perf_counter() - t
        if out.get("digest"):
            self.log("info", f"Merged the {out['merged']} layers the steps wrote into one",
                     "finalize")

    async def _cleanup(self) -> None:
        mx = self.p.machines
        if self.vm is not None:
            await mx.release_vm(self.vm)
            self.vm = None
        with contextlib.suppress(Exception):
            await mx.drop_stack(self.stack)
        if self.net_made:
            await mx.drop_net(self.stack)
            self.net_made = False
