"""Builders: a template build's VM restored from a snapshot instead of cold-booted (issue 31).

A cold boot of a build VM is mostly envd starting (under TCG ~4.7 s of a ~5 s boot: the
Python of the frozen envd, translated). A builder is a VM booted once from a disk that
holds only our init, envd and the builder mark (imports.builder_layers): init copies itself
and envd into a tmpfs root and unmounts the disk (rootfs/init/init.c), envd starts with
its unpacked files under /run, and the VM's state is saved (`save_state`: the device state;
its RAM stays in its share=on file):

    builders/<key>/ram, state      key: the build VM's config digest (kernel, command
                                   line, machine), its disk's size, the VMM's identity
    a build: `ram` copied to the build's RAM file, `state` restored on the build's own
    disk stack -> envd answers at once -> POST /init (the host's clock, fresh entropy)
    -> `aenv-init switch-root [--growfs]` as root: /dev/vda (the build's disk, the size
       the builder's was) mounted and every process pivoted onto it
    -> the steps, the start command, the memory frozen: as after a cold boot

A builder is made by the first build that wants one, beside that build's image import
(its boot overlaps the import), one per key at a time, and kept (the MAX_KEPT most
recently used). Used for builds from an OCI image on QEMU: the Firecracker driver boots
its build VMs (its restore onto a disk of other content needs the drive swapped after the
load; not built).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from host.contract import BuildFailed, BuildLog, BuildSpec
from host.network import NetworkPolicy
from host.vmm.driver import MemoryBacking, Vm, VmSpec
from host.vmm.errors import VmmError
from host.vmm.image import GuestImage, find_image

from .builderstore import Builder
from .guest_shell import GuestCommandError, GuestShell, OnOutput
from .imports import INIT, builder_layers, image_to_import, imported_cmdline, ours_id
from .parts import NodeParts

log = logging.getLogger(__name__)

BUILDER_READY = "/run/aenv/builder"  # rootfs/init/init.c: "ready" once its disk is let go
# Under TCG, the build VM's translated code kept before a flush (VmSpec.tcg_tb_mib): its
# cold boot translates over the 64 MiB a sandbox gets; at 128 it boots in 4.88 s instead
# of 5.13 s (bench/bench_boot.py, 3 boots each), more gains nothing (256: 4.84 s). One
# VM per build, gone after it: the memory is the build's for seconds.
BUILD_TCG_TB_MIB = 128


class BuilderUse:
    """One build's use of the node's builder: found or made in a task beside the build's
    image import (`start`), taken if it is for this build's VM (`take`), restored and
    switched onto the build's disk (`restore`; a failure drops the builder and the build
    cold-boots); `close` ends a task the build did not use."""

    def __init__(self, p: NodeParts, spec: BuildSpec, stack: str, log_: BuildLog) -> None:
        self.p, self.spec, self.stack, self.log = p, spec, stack, log_
        self.task: asyncio.Task[Builder] | None = None
        self.m: dict[str, Any] = {}
        self.size = 0
        self.key = ""

    async def start(self, size: int) -> None:
        """For a build from an OCI image on QEMU, on a node with builders: the builder for
        its build VM, on a disk of `size` bytes, whose command line is our init's on the
        built-in image's kernel. Nothing for any other build."""
        p, spec = self.p, self.spec
        if p.builders is None or image_to_import(spec) is None or \
                p.machines.vmm.name != "qemu":
            return
        base = await asyncio.to_thread(find_image, spec.machine.image, p.config.image_cache)
        cmdline = f"{imported_cmdline(base)} {p.machines.guest_net_cmdline()}".strip()
        self.m = {"machine": dataclasses.asdict(spec.machine), "cmdline": cmdline,
                  "kernel": str(base.kernel.vmlinux)}
        self.size = size
        self.key = await key(p, self.m, size, base)
        self.task = asyncio.create_task(get(p, self.key, self.m, size, base, self.log,
                                            name=f"{self.stack}-b"))

    async def take(self, m: dict[str, Any], size: int) -> Builder | None:
        """The builder, if its VM is this build's (machine, command line, kernel, a disk
        of `size` bytes) and it could be made; None: the build cold-boots."""
        task, self.task = self.task, None
        if task is None:
            return None
        try:
            b = await task
        except Exception as exc:  # noqa: BLE001 - a builder only saves time: never fatal
            self.log("warn", f"no builder ({_why(exc)}): cold-booting the build VM", "base")
            return None
        if size != self.size or any(m[k] != self.m[k] for k in ("machine", "cmdline",
                                                                "kernel")):
            return None
        return b

    async def restore(self, b: Builder, spec: VmSpec, shell: GuestShell, *, grow: bool,
                      on_output: OnOutput) -> tuple[Vm, dict[str, float]] | None:
        """The build VM from `b`, on the build's disk; None (the builder dropped, the VM
        gone) if that failed."""
        vm: Vm | None = None
        try:
            vm, timings = await restore(self.p, b, spec)
            await switch_root(shell, grow=grow, on_output=on_output)
            return vm, timings
        except Exception as exc:  # noqa: BLE001 - as in `take`: the build cold-boots
            self.log("warn", f"the builder failed ({_why(exc)}): dropped, cold-booting",
                     "base")
            if vm is not None:
                await self.p.machines.release_vm(vm)
            assert self.p.builders is not None
            await asyncio.to_thread(self.p.builders.drop, self.key)
            return None

    async def close(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def key(p: NodeParts, m: dict[str, Any], size: int, base: GuestImage) -> str:
    """What a builder for a build VM of manifest-like `m` on a disk of `size` bytes
    depends on: the VM's config digest (the command line is the build VM's, network part
    included), the disk's size, the VMM's identity, and our init and envd (they run on
    from the builder's memory in every template made with it)."""
    identity = (await p.machines.identity()).to_json()
    text = json.dumps([p.machines.restore_digest(m), size, identity, ours_id(base)],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


async def get(p: NodeParts, key_: str, m: dict[str, Any], size: int, base: GuestImage,
              log_: BuildLog, *, name: str) -> Builder:
    """The node's builder of `key_`, made now (a boot) if there is none, by a VM, stack
    and network called `name` (a build's: `<build stack>-b`, which the reaping of
    orphans leaves alone while the build runs)."""
    assert p.builders is not None

    async def make(b: Builder) -> None:
        t = time.perf_counter()
        await _boot(p, b, m, size, base, log_, name)
        log_("info", f"Made a builder for this machine in {time.perf_counter() - t:.1f}s "
             "(once per node)", "base")

    return await p.builders.get(key_, make)


async def _boot(p: NodeParts, b: Builder, m: dict[str, Any], size: int, base: GuestImage,
                log_: BuildLog, name: str) -> None:
    """Boot a builder VM (its disk: imports.builder_layers, of `size` bytes) and save its
    state into `b`; nothing of the VM is left."""
    mx, client = p.machines, p.block.client
    layers = await builder_layers(p, base, log_, name=name)
    await mx.drop_stack(name)
    await client.create(name, list(layers), virtual_size=size)
    vm: Vm | None = None
    try:
        _net, (network, host, port, _fwd) = await mx.make_net(name, NetworkPolicy())
        try:
            spec = builder_spec(p, m, name=name, ram=b.ram, network=network)
            vm, _stages = await mx.boot(spec, timeout_s=p.config.boot_timeout_s)
            await _check_ready(host, port)
            await vm.save_state(b.state)
        finally:
            if vm is not None:
                await mx.release_vm(vm)
            await mx.drop_net(name)
    finally:
        await mx.drop_stack(name)


async def _check_ready(host: str, port: int) -> None:
    """Init's word that the builder runs on its tmpfs root with its disk let go (a
    builder still on its disk would, restored on another, meet its own stale filesystem
    there): without it no builder is saved and the build cold-boots."""
    shell = GuestShell(host, port)
    try:
        said = await shell.read_file(BUILDER_READY, limit=4096)
    except GuestCommandError as exc:
        raise BuildFailed(f"the builder's state: {exc}", step="base") from exc
    finally:
        await shell.aclose()
    if said is None or said.strip() != b"ready":
        raise BuildFailed("the builder did not leave its disk (see the node's log)",
                          step="base")


def builder_spec(p: NodeParts, m: dict[str, Any], *, name: str, ram: Path,
                 network: Any) -> VmSpec:
    """A build VM's spec (a builder's, and a build's restored from it): RAM in `ram`
    (share=on), disk stack `name`."""
    return dataclasses.replace(
        p.machines.spec(m, name=name, memory=MemoryBacking(path=ram, shared=True),
                        stack=name, network=network), tcg_tb_mib=BUILD_TCG_TB_MIB)


async def restore(p: NodeParts, b: Builder, spec: VmSpec) -> tuple[Vm, dict[str, float]]:
    """A build VM of `spec` from builder `b` (its RAM copied to `spec.memory.path`), envd
    answering; killed on any failure."""
    assert spec.memory is not None
    t0 = time.perf_counter()
    await asyncio.to_thread(_copy_sparse, b.ram, spec.memory.path)
    t1 = time.perf_counter()
    if spec.work_dir is not None:
        shutil.rmtree(spec.work_dir, ignore_errors=True)
    try:
        vm = await p.machines.vmm.restore(spec, b.state)
    except VmmError as exc:
        raise BuildFailed(f"restoring the build VM from its builder failed: {exc}",
                          step="base") from exc
    try:
        await vm.wait_for_envd(p.config.envd_timeout_s)
    except BaseException:
        await p.machines.release_vm(vm)
        raise
    return vm, {"builder_copy_s": t1 - t0, "builder_restore_s": time.perf_counter() - t1}


async def switch_root(shell: GuestShell, *, grow: bool, on_output: OnOutput) -> None:
    """The restored builder onto the build's disk: the host's clock and entropy first
    (the builder's are the snapshot's), then init's switch-root."""
    try:
        await shell.init_clock()
        code = await shell.run([INIT, "switch-root", *(["--growfs"] if grow else [])],
                               user="root", timeout_s=120.0, on_output=on_output)
    except GuestCommandError as exc:
        raise BuildFailed(f"switching the build VM onto its disk: {exc}", step="base") from exc
    if code != 0:
        raise BuildFailed(f"switching the build VM onto its disk failed (exit {code})",
                          step="base")


def _copy_sparse(src: Path, dest: Path) -> None:
    """A builder's RAM file copied for one build. `src` may vanish meanwhile: another
    build whose switch failed dropped that builder (BuildFailed: this build cold-boots)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        dest.unlink()
    res = subprocess.run(["cp", "--sparse=always", str(src), str(dest)],
                         check=False, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildFailed(f"copying the builder's memory: {res.stderr.strip()[-300:]}",
                          step="base")


def _why(exc: BaseException) -> str:
    """An error for the build's log: its message, or its type where it has none."""
    return str(exc) or type(exc).__name__
