"""Starting sandboxes: restore a snapshot's memory and disk, or cold-boot its disk.

restore: refuse memory saved by another VMM (version, accelerator, CPU model: the
snapshot's `vmm`) -> fetch the memory files the manifest lists (a fresh node, an evicted
cache), pinned until the VM maps them -> network + stack `sbx-<sid>` over the snapshot's
layers -> the driver restores the base (+ diff chain) copy-on-write -> envd /health. cold
boot (`reboot`, or a filesystem-only snapshot): the same disk, RAM in a share=on file in
the VM's work dir, so later snapshots can freeze a new base. Any failure rolls everything
back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from host.contract import MachineSpec, NetworkConfig, Placement, SnapshotRef
from host.vmm.driver import MemoryBacking, Vm
from host.vmm.identity import VmmIdentity, describe
from host.vmm.memsnap import BaseImage, MemSnapError, MemSnapshot

from .errors import (
    NodeRuntimeError,
    SandboxStartError,
    SnapshotCorruptError,
    SnapshotIncompatibleError,
)
from .forkimages import ForkImageError
from .parts import NodeParts
from .sandbox import RunningSandbox, boot_of, disk_base, policy_of

log = logging.getLogger(__name__)


def stages(timings: dict[str, float]) -> str:
    """`a 12ms, b 3ms, ...` of the `*_s` timings (log lines an operator can read)."""
    return ", ".join(f"{k[:-2]} {v * 1e3:.0f}ms" for k, v in timings.items()
                     if k.endswith("_s") and k != "total_s")


async def start(p: NodeParts, sandbox_id: str, snapshot: SnapshotRef, network: NetworkConfig,
                *, reboot: bool, hold: bool = False, fanout: int = 1) -> Placement:
    await p.settle(sandbox_id)  # a pause's teardown of this id's network and stack
    if not (hold or reboot):
        warm = await _continue_held(p, sandbox_id, snapshot, network)
        if warm is not None:
            return warm
    if sandbox_id in p.sandboxes or sandbox_id in p.busy:
        raise NodeRuntimeError(f"sandbox {sandbox_id} already exists on this node")
    p.busy.add(sandbox_id)
    try:
        m = await p.manifests.get(snapshot.snapshot_id)
        if m.get("network_mode") != p.machines.mode:
            raise SandboxStartError(
                f"snapshot {snapshot.snapshot_id} was taken with {m.get('network_mode')} "
                f"networking; this node runs {p.machines.mode}")
        restore = not reboot and m.get("memory") is not None
        if hold and not restore:
            raise NodeRuntimeError(f"only a restore can be held (snapshot "
                                   f"{snapshot.snapshot_id} is booted)")
        # A restore's memory dirs are pinned from before their fetch until the sandbox is
        # live (its VM's dirs pin them then): another start's trim must not evict them.
        # Its layers from the manifest's read (no await between) until its stack holds
        # them: a collection listing the documents after the snapshot's delete keeps them.
        with p.pin_layers(m["disk"]["layers"]), \
                p.memory.pin(p.memory.needed(m) if restore else ()):
            if restore:
                sb = await _restore(p, sandbox_id, snapshot.snapshot_id, m, network, fanout)
            else:
                sb = await _boot(p, sandbox_id, snapshot.snapshot_id, m, network)
            if hold:
                try:
                    await sb.vm.pause()
                except BaseException:
                    await p.machines.unprovision(sandbox_id, sb.vm)
                    raise
                sb.held = True
            p.sandboxes[sandbox_id] = sb
        p.compactor.request(sb)  # a resume restored the chain its manifest names
        p.last_timings = sb.timings
        log.info("sandbox %s %s from %s in %.0f ms: %s", sandbox_id,
                 ("restored" if sb.base_dir is not None else "booted") + (" (held)" if hold else ""),
                 snapshot.snapshot_id, sb.timings.get("total_s", 0.0) * 1e3, stages(sb.timings))
    finally:
        p.busy.discard(sandbox_id)
    await p.trim_memory()
    return sb.placement()


async def _continue_held(p: NodeParts, sid: str, snapshot: SnapshotRef,
                         network: NetworkConfig) -> Placement | None:
    """Continue the VM a `hold` start left stopped for `sid` (restored, envd answered once:
    its guest code is translated and its network is up). None: there is none, or it is
    not usable for this start (another snapshot or network policy, or it died): it is
    released and the caller starts as usual."""
    sb = p.sandboxes.get(sid)
    if sb is None or not sb.held:
        return None
    t0 = time.perf_counter()
    async with sb.lock:
        if p.sandboxes.get(sid) is not sb or not sb.held:
            return None
        try:
            if (sb.snapshot_id != snapshot.snapshot_id or policy_of(network) != sb.policy
                    or not sb.vm.alive()):
                raise NodeRuntimeError("held VM unusable")
            await sb.vm.resume()
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, a fresh start follows
            log.warning("sandbox %s: its held VM cannot be continued (%s): starting anew",
                        sid, exc)
            await p.release(sb)
            return None
        sb.held = False
    sb.timings = {"continue_held_s": time.perf_counter() - t0,
                  "total_s": time.perf_counter() - t0}
    p.last_timings = sb.timings
    log.info("sandbox %s continued from %s (held) in %.0f ms", sid, snapshot.snapshot_id,
             sb.timings["total_s"] * 1e3)
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


REBOOT_HINT = ('resume it with a reboot instead (E2B SDK: connect(on_resume="reboot"); '
               'REST: connect with memory=false; `aenv resume --reboot`): its disk is kept, '
               'its running processes are not')


def check_vmm(snapshot_id: str, m: dict[str, Any], current: VmmIdentity) -> None:
    """Refuse memory saved under another VMM identity than this node's (the manifest's
    `vmm`; a snapshot without one, or without some field, predates them: accepted)."""
    recorded = m.get("vmm") or {}
    diff = current.differences(recorded)
    if not diff:
        return
    what = "; ".join(f"{name} {old!r} here is {new!r}" for name, old, new in diff)
    hint = "rebuild the template" if m.get("kind") == "template" else REBOOT_HINT
    raise SnapshotIncompatibleError(
        f"snapshot {snapshot_id} holds memory saved by {describe(recorded)}, but this node "
        f"runs {current.describe()} ({what}): that memory cannot be restored here; {hint}")


async def _restore(p: NodeParts, sid: str, snapshot_id: str, m: dict[str, Any],
                   network: NetworkConfig, fanout: int = 1) -> RunningSandbox:
    t0 = time.perf_counter()
    mx = p.machines
    current = await mx.identity()
    check_vmm(snapshot_id, m, current)  # before anything is fetched or made
    await p.memory.fetch(m)
    timings: dict[str, float] = {"fetch_memory_s": time.perf_counter() - t0}
    base, snap = await _load_memory(p, snapshot_id, m)
    memory_sha256 = dict(m["memory"].get("sha256") or {})
    if snap is not None and p.forks.use(snapshot_id, snap, fanout):
        # one image the fork's children share instead of a copy of the chain each
        try:
            base, flat_sha, made = await p.forks.image(snapshot_id, base, snap)
        except ForkImageError as exc:
            log.warning("sandbox %s: restoring the chain of %s instead (%s)", sid,
                        snapshot_id, exc)
        else:
            snap = None
            memory_sha256.update(flat_sha)
            timings.update(made)
    policy = policy_of(network)
    stack = f"sbx-{sid}"
    vm: Vm | None = None
    vnet, host, port, host_port = await mx.provision(sid, m["disk"]["layers"], policy)
    try:
        spec = mx.spec(m, name=sid, memory=MemoryBacking(path=base.mem_path, shared=False),
                       stack=stack, network=vnet)
        if mx.digest(spec) != m["config_sha256"]:
            raise SnapshotIncompatibleError(
                f"snapshot {snapshot_id} was taken with another VMM configuration (kernel, "
                f"cmdline, machine, VMM binary or flags differ on this node): "
                f"{REBOOT_HINT}")
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
            timings=timings, vmm=current.to_json(), disk_base=disk_base(m, sid),
            memory_sha256=memory_sha256)
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
    current = await mx.identity()
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
            timings=timings, scratch=scratch, vmm=current.to_json(),
            disk_base=disk_base(m, sid))
    except BaseException:
        await mx.unprovision(sid, vm)
        raise
