"""Starting sandboxes: restore a snapshot's memory and disk, or cold-boot its disk.

restore: fetch the memory files the manifest lists (a fresh node, an evicted cache) ->
network + stack `sbx-<sid>` over the snapshot's layers -> the driver restores the base
(+ diff chain) copy-on-write -> envd /health. cold boot (`reboot`, or a filesystem-only
snapshot): the same disk, RAM in a share=on file in the VM's work dir, so later snapshots
can freeze a new base. Any failure rolls everything back.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from host.contract import MachineSpec, NetworkConfig, Placement, SnapshotRef
from host.vmm.driver import MemoryBacking, Vm
from host.vmm.memsnap import BaseImage, MemSnapError, MemSnapshot

from .errors import NodeRuntimeError, SandboxStartError, SnapshotCorruptError
from .parts import NodeParts
from .sandbox import RunningSandbox, boot_of, policy_of


async def start(p: NodeParts, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig,
                *, reboot: bool) -> Placement:
    if sandbox_id in p.sandboxes or sandbox_id in p.busy:
        raise NodeRuntimeError(f"sandbox {sandbox_id} already exists on this node")
    p.busy.add(sandbox_id)
    try:
        m = await p.manifests.get(snapshot.snapshot_id)
        if m.get("network_mode") != p.machines.mode:
            raise SandboxStartError(
                f"snapshot {snapshot.snapshot_id} was taken with {m.get('network_mode')} "
                f"networking; this node runs {p.machines.mode}")
        if reboot or m.get("memory") is None:
            sb = await _boot(p, sandbox_id, snapshot.snapshot_id, m, network)
        else:
            sb = await _restore(p, sandbox_id, snapshot.snapshot_id, m, network)
        p.sandboxes[sandbox_id] = sb
        p.last_timings = sb.timings
    finally:
        p.busy.discard(sandbox_id)
    await p.trim_memory()
    return sb.placement()


async def _load_memory(p: NodeParts, snapshot_id: str, m: dict[str, Any]
                       ) -> tuple[BaseImage, MemSnapshot | None]:
    mem = p.memory
    try:
        base = await asyncio.to_thread(BaseImage.load, mem.path(m["memory"]["base_dir"]))
        snap = None
        if m["memory"].get("snapshot_dir"):
            snap = await asyncio.to_thread(MemSnapshot.load, mem.path(m["memory"]["snapshot_dir"]))
    except (MemSnapError, OSError) as exc:
        raise SnapshotCorruptError(f"snapshot {snapshot_id}: {exc}") from exc
    return base, snap


async def _restore(p: NodeParts, sid: str, snapshot_id: str, m: dict[str, Any],
                   network: NetworkConfig) -> RunningSandbox:
    t0 = time.perf_counter()
    mx = p.machines
    await p.memory.fetch(m)
    timings: dict[str, float] = {"fetch_memory_s": time.perf_counter() - t0}
    base, snap = await _load_memory(p, snapshot_id, m)
    policy = policy_of(network)
    stack = f"sbx-{sid}"
    vm: Vm | None = None
    vnet, host, port, host_port = await mx.provision(sid, m["disk"]["layers"], policy)
    try:
        spec = mx.spec(m, name=sid, memory=MemoryBacking(path=base.mem_path, shared=False),
                       stack=stack, network=vnet)
        if mx.digest(spec) != m["config_sha256"]:
            raise SandboxStartError(
                f"snapshot {snapshot_id} was taken with another VMM configuration (kernel, "
                f"cmdline, machine or VMM flags differ on this node): resume it with a "
                f"reboot (filesystem only) instead")
        timings["prepare_s"] = time.perf_counter() - t0
        vm, stages = await mx.restore(spec, base, snap, timeout_s=p.config.envd_timeout_s,
                                      what=snapshot_id)
        timings.update(stages)
        timings["total_s"] = time.perf_counter() - t0
        return RunningSandbox(
            sandbox_id=sid, vm=vm, mode=mx.mode, stack=stack, boot=boot_of(m),
            snapshot_id=snapshot_id, base_dir=base.dir,
            memsnap_dir=snap.dir if snap is not None else None,
            config_sha256=m["config_sha256"], machine=MachineSpec(**m["machine"]),
            envd_host=host, envd_port=port, policy=policy, host_port=host_port,
            timings=timings)
    except BaseException:
        await mx.unprovision(sid, vm)
        raise


async def _boot(p: NodeParts, sid: str, snapshot_id: str, m: dict[str, Any],
                network: NetworkConfig) -> RunningSandbox:
    t0 = time.perf_counter()
    mx = p.machines
    policy = policy_of(network)
    stack = f"sbx-{sid}"
    vm: Vm | None = None
    vnet, host, port, host_port = await mx.provision(sid, m["disk"]["layers"], policy)
    try:
        scratch = p.config.vms_dir / sid / "ram.mem"
        spec = mx.spec(m, name=sid, memory=MemoryBacking(path=scratch, shared=True),
                       stack=stack, network=vnet)
        timings = {"prepare_s": time.perf_counter() - t0}
        vm, stages = await mx.boot(spec, timeout_s=p.config.boot_timeout_s)
        timings.update(stages)
        timings["total_s"] = time.perf_counter() - t0
        return RunningSandbox(
            sandbox_id=sid, vm=vm, mode=mx.mode, stack=stack, boot=boot_of(m),
            snapshot_id=snapshot_id, base_dir=None, memsnap_dir=None,
            config_sha256=mx.digest(spec), machine=MachineSpec(**m["machine"]),
            envd_host=host, envd_port=port, policy=policy, host_port=host_port,
            timings=timings, scratch=scratch)
    except BaseException:
        await mx.unprovision(sid, vm)
        raise
