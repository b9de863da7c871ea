"""Template builds: cold-boot an image, freeze its memory once envd answers, seal its disk.

    image layers -> stack `tpl-<id>` -> cold boot with RAM in a share=on file (in a netns,
    guest network from the kernel command line) -> envd /health -> freeze the memory base
    (`memory/<id>/base/`) -> seal the disk -> kill -> memory files into the repository ->
    manifest (the commit point)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import time
from typing import Any

from host.contract import MachineSpec, SnapshotRef
from host.network import NetworkPolicy
from host.vmm.driver import MemoryBacking, Vm
from host.vmm.errors import VmmError
from host.vmm.image import find_image

from .errors import NodeRuntimeError, SandboxStartError
from .layers import image_layers
from .manifests import VERSION
from .parts import NodeParts


async def build_template(rt: NodeParts, template_id: str, machine: MachineSpec) -> SnapshotRef:
    if template_id in rt.building:
        raise NodeRuntimeError(f"template {template_id} is already being built")
    rt.building.add(template_id)
    try:
        return await _build(rt, template_id, machine)
    finally:
        rt.building.discard(template_id)


async def _build(rt: NodeParts, template_id: str, machine: MachineSpec) -> SnapshotRef:
    t0 = time.perf_counter()
    mx, mem = rt.machines, rt.memory
    mem_root = mem.dir / template_id
    stack = f"tpl-{template_id}"
    vm: Vm | None = None
    net_made = False
    timings: dict[str, float] = {}
    try:
        image = await asyncio.to_thread(find_image, machine.image, rt.config.image_cache)
        layers = await image_layers(image, rt.block.client, rt.config.state_dir / "layers.json")
        timings["layers_s"] = time.perf_counter() - t0
        if mem_root.exists():
            shutil.rmtree(mem_root)
        mem_root.mkdir(parents=True)
        net, (network, _host, _port, _fwd) = await mx.make_net(stack, NetworkPolicy())
        net_made = True
        cmdline = image.cmdline + (f" {net.kernel_cmdline()}" if net is not None else "")
        m: dict[str, Any] = {
            "version": VERSION, "kind": "template", "snapshot_id": template_id,
            "machine": dataclasses.asdict(machine), "network_mode": mx.mode,
            "image": image.name, "kernel": str(image.kernel.vmlinux),
            "cmdline": cmdline.strip(),
        }
        await mx.drop_stack(stack)
        await rt.block.client.create(stack, layers)
        scratch = mem_root / "scratch.mem"
        spec = mx.spec(m, name=stack, memory=MemoryBacking(path=scratch, shared=True),
                       stack=stack, network=network)
        t1 = time.perf_counter()
        vm, boot = await mx.boot(spec, timeout_s=rt.config.boot_timeout_s)
        timings.update(boot)
        t2 = time.perf_counter()
        try:
            base = await vm.freeze_memory(mem_root / "base")
        except VmmError as exc:
            raise SandboxStartError(f"template {template_id}: freezing memory: {exc}") from exc
        await rt.block.client.seal(stack, upload=True)
        info = await rt.block.client.info(stack)
        timings["freeze_s"] = time.perf_counter() - t2
        timings["boot_to_frozen_s"] = time.perf_counter() - t1
        await mx.release_vm(vm)
        vm = None
        scratch.unlink(missing_ok=True)
        await mx.drop_stack(stack)
        await mx.drop_net(stack)
        net_made = False
        t3 = time.perf_counter()
        files = await mem.upload(base.dir)
        timings["upload_memory_s"] = time.perf_counter() - t3
        m.update({
            "created_at": time.time(), "parent_id": None,
            "config_sha256": mx.digest(spec),
            "memory": {"base_dir": mem.rel(base.dir), "base_id": base.id,
                       "devstate": mem.rel(base.template_path), "snapshot_dir": None,
                       "files": files},
            "disk": {"layers": list(info.layers), "virtual_size": info.virtual_size},
            "depends_on": [template_id],
            "timings": {k: round(v, 3) for k, v in timings.items()},
        })
        await rt.manifests.put(template_id, m)
        rt.last_timings = timings
        return SnapshotRef(template_id, machine, m["created_at"], None, m)
    except BaseException:
        if vm is not None:
            await mx.release_vm(vm)
        with contextlib.suppress(Exception):
            await mx.drop_stack(stack)
        if net_made:
            await mx.drop_net(stack)
        shutil.rmtree(mem_root, ignore_errors=True)
        raise
