"""After a host-service restart: re-attach to live VMs (`adopt`), keep the disk of a
sandbox whose VM died meanwhile (`salvage`), and remove what no known sandbox owns
(`reap_orphans`): VMM processes, work dirs, stacks and namespaces."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from host.contract import Placement, SnapshotRef
from host.storage.errors import StorageError
from host.vmm.driver import Vm, VmSpec

from . import snapshots
from .parts import NodeParts, build_stack
from .sandbox import RunningSandbox

log = logging.getLogger(__name__)


async def adopt(p: NodeParts, sandbox_id: str, facts: dict[str, Any]) -> Placement | None:
    if sandbox_id in p.sandboxes:
        return p.sandboxes[sandbox_id].placement()
    mx = p.machines
    vm = await mx.adopt_vm(sandbox_id, facts) if facts.get("mode") == mx.mode else None
    if vm is None:
        # the disk stays for `salvage` (or reap_orphans, which drops what nobody kept)
        await mx.release_leftovers(sandbox_id, facts, keep_stack=True)
        return None
    try:
        await p.block.client.info(str(facts["stack"]))
        sb = RunningSandbox.from_facts(sandbox_id, vm, facts)
    except (KeyError, TypeError, ValueError, StorageError) as exc:
        log.warning("cannot adopt %s (%s): releasing it", sandbox_id, exc)
        await mx.release_vm(vm)
        await mx.release_leftovers(sandbox_id, facts)
        return None
    p.sandboxes[sandbox_id] = sb
    p.compactor.request(sb)
    return sb.placement()


class _GoneVm:
    """The VM of a sandbox that died while the service was down: what `snapshots`
    asks of a VM it does not pause (it is not alive) and releases (nothing to kill)."""

    def __init__(self, sandbox_id: str, work_dir: Path) -> None:
        self.spec = VmSpec(kernel=None, network=None, name=sandbox_id, work_dir=work_dir)

    def alive(self) -> bool:
        return False

    async def kill(self) -> None:
        return None


async def salvage(p: NodeParts, sandbox_id: str, facts: dict[str, Any],
                  snapshot_id: str) -> SnapshotRef | None:
    try:
        await p.block.client.info(str(facts["stack"]))
        vm: Vm = _GoneVm(sandbox_id, p.config.vms_dir / sandbox_id)  # type: ignore[assignment]
        sb = RunningSandbox.from_facts(sandbox_id, vm, facts)
    except (KeyError, TypeError, ValueError, StorageError) as exc:
        log.info("sandbox %s: no disk to keep (%s)", sandbox_id, exc)
        return None
    p.sandboxes[sandbox_id] = sb
    try:
        ref = await snapshots.snapshot(p, sandbox_id, snapshot_id, stop=True, memory=False)
    except Exception:
        log.exception("sandbox %s: keeping its disk failed", sandbox_id)
        if p.sandboxes.get(sandbox_id) is sb:
            await p.release(sb)
        return None
    log.info("sandbox %s: its VM was gone; its disk is kept as snapshot %s", sandbox_id,
             snapshot_id)
    return ref


async def adopt_networks(p: NodeParts) -> None:
    """Hand adopted sandboxes' namespaces to the NetworkManager (removing other
    leftovers with our prefix that no live sandbox owns)."""
    nm = p.machines.nm
    if nm is None:
        return
    keep = {sid: sb.policy for sid, sb in p.sandboxes.items() if sid not in nm.networks}
    await nm.recover(keep)


async def kill(p: NodeParts, sandbox_id: str) -> None:
    await p.settle(sandbox_id)  # a pause's teardown still running: let it finish first
    sb = p.sandboxes.get(sandbox_id)
    if sb is None:
        await p.machines.release_leftovers(sandbox_id, None)
        return
    async with sb.lock:
        if p.sandboxes.get(sandbox_id) is sb:
            await p.release(sb)


async def reap_orphans(p: NodeParts, known: set[str]) -> list[str]:
    await p.settle()
    reaped: set[str] = set()
    for sid in list(p.sandboxes):
        if sid not in known:
            await kill(p, sid)
            reaped.add(sid)
    mx = p.machines
    live = set(p.sandboxes) | p.busy
    building = {build_stack(t) for t in p.building}
    vms_dir: Path = p.config.vms_dir
    stale = await asyncio.to_thread(mx.vmm.leftover_names, vms_dir)
    def building_part(name: str) -> bool:
        """A build's VM, its import's stack (-t), its builder's (-b, -b-t)."""
        return any(name == b or name.startswith(f"{b}-") for b in building)

    for sid in sorted(s for s in stale - live if not building_part(s)):
        await mx.release_leftovers(sid, None)
        reaped.add(sid)
    for info in await p.block.client.list():
        if info.name.startswith("sbx-") and info.name[4:] not in live:
            await mx.drop_stack(info.name)
            reaped.add(info.name[4:])
        elif info.name.startswith("tpl-") and not building_part(info.name):
            await mx.drop_stack(info.name)
    if mx.nm is not None:
        before = {ex.sandbox_id for ex in await mx.nm.list_existing() if ex.sandbox_id}
        await adopt_networks(p)
        reaped |= {s for s in before if s not in live and not s.startswith("tpl-")}
    return sorted(reaped)
