"""Kept VMs of paused sandboxes (host/orchestrator/kept.py): a pause keeps its VM stopped
for `keep_paused_s`, a resume meanwhile continues it (no restore), and the VM is given
back when the window ends, on a kill, on a resume by reboot, under memory pressure, when
admission would refuse a start, and at shutdown; pauses made to free memory and pauses
on a node in a cluster never keep one. The fake runtime stands in for VMs (the real
thing: tests/e2e/test_kept_vms.py)."""

from __future__ import annotations

import asyncio

import pytest

from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import CapacityExceeded
from host.orchestrator.model import CreateRequest
from host.orchestrator.pressure import PressureGuard, PressurePolicy
from host.orchestrator.states import SandboxState as S
from tests.metrics.scrape import parse

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
async def make(store, rt, envd):
    made: list[NodeOrchestrator] = []

    async def make(keep_s: float = 60.0, **kw) -> NodeOrchestrator:
        o = NodeOrchestrator(store, rt, domain="sbx.test", keep_paused_s=keep_s,
                             envd=EnvdClient(transport=envd.transport()), **kw)
        await o.start(ttl_interval_s=3600)
        made.append(o)
        return o

    yield make
    for o in made:
        await o.aclose()


async def paused(o: NodeOrchestrator) -> tuple[str, int]:
    """A sandbox created and paused (committed): its id and its VM's number."""
    info = await o.create(CreateRequest())
    vm = o.runtime.vms[info.sandbox_id].facts["vm"]  # type: ignore[attr-defined]
    await o.pause(info.sandbox_id)
    async with o._ctx.lock(info.sandbox_id):  # the commit holds it
        pass
    assert o.store.get_sandbox(info.sandbox_id).state is S.PAUSED
    return info.sandbox_id, vm


async def test_a_resume_continues_the_vm_its_pause_kept(make, rt, envd, store) -> None:
    o = await make()
    sid, vm = await paused(o)
    assert sid in rt.warm and sid in o.kept.until  # stopped, kept
    assert rt.vms[sid].facts["from"] == store.get_sandbox(sid).snapshot_id
    inits = len(envd.inits)
    info, resumed = await o.connect(sid, 60)
    assert resumed and info.state is S.RUNNING
    assert rt.vms[sid].facts["vm"] == vm  # the same VM, continued: no restore
    assert sid not in rt.warm and sid not in o.kept.until
    assert len(envd.inits) == inits + 1  # envd is /init-ed as after any resume
    # paused again: kept again, and continued again
    await o.pause(sid)
    async with o._ctx.lock(sid):
        pass
    assert sid in o.kept.until
    await o.connect(sid, 60)
    assert rt.vms[sid].facts["vm"] == vm


async def test_kept_vms_are_counted_at_each_scrape(make) -> None:
    o = await make()

    async def spare(kind: str) -> float:
        return parse((await o.service_metrics.render()).decode()).value(
            "aenv_spare_vms", kind=kind)

    assert (await spare("kept"), await spare("warm")) == (0, 0)
    sid, _ = await paused(o)
    assert await spare("kept") == 1
    await o.connect(sid, 60)
    assert await spare("kept") == 0


async def test_the_kept_vm_goes_when_its_window_ends(make, rt, store) -> None:
    o = await make(keep_s=0.2)
    sid, vm = await paused(o)
    assert sid in rt.vms
    for _ in range(300):
        if sid not in rt.vms:
            break
        await asyncio.sleep(0.01)
    assert sid not in rt.vms and o.kept.until == {}
    assert store.get_sandbox(sid).state is S.PAUSED  # the pause itself stays
    await o.connect(sid, 60)
    assert rt.vms[sid].facts["vm"] != vm  # restored from the snapshot: a new VM


async def test_kill_and_reboot_release_the_kept_vm(make, rt, store) -> None:
    o = await make()
    killed, _ = await paused(o)
    await o.kill(killed)
    assert killed not in rt.vms and killed not in o.kept.until
    assert store.get_sandbox(killed).state is S.KILLED

    rebooted, vm = await paused(o)
    await o.connect(rebooted, 60, memory=False)
    assert rebooted in rt.reboots and rt.vms[rebooted].facts["vm"] != vm
    assert ("kill", (rebooted,)) in rt.calls and rebooted not in o.kept.until


async def test_memory_pressure_releases_kept_vms_and_never_keeps_its_own(make, rt,
                                                                         store) -> None:
    o = await make()
    sid, _ = await paused(o)
    running = (await o.create(CreateRequest())).sandbox_id
    available = {"mib": 500}

    async def released() -> int:  # a kept VM gives its memory back
        n = await type(o).release_spare(o)
        available["mib"] += 300 * n
        return n

    o.release_spare = released  # type: ignore[method-assign]
    guard = PressureGuard(o, PressurePolicy(low_mib=1000, high_mib=1500),
                          available_mib=lambda: available["mib"])
    assert await guard.tick() == [running]  # the kept VM went first, then not enough
    assert sid not in rt.vms and o.kept.until == {}
    assert store.get_sandbox(running).state is S.PAUSED
    assert running not in rt.vms  # a pause to free memory keeps nothing


async def test_a_start_admission_would_refuse_releases_kept_vms_first(make, rt,
                                                                      store) -> None:
    o = await make()
    sid, _ = await paused(o)
    other, _ = await paused(o)
    available = {"mib": 1000}
    admission = o._ctx.admission
    admission._available_mib = lambda: available["mib"]  # type: ignore[method-assign]
    spare = admission.spare
    assert spare is not None

    async def released() -> int:
        n = await spare()
        available["mib"] += 400 * n
        return n

    admission.spare = released
    info = await o.create(CreateRequest())  # refused at 1000 MiB, admitted once released
    assert store.get_sandbox(info.sandbox_id).state is S.RUNNING
    assert sid not in rt.vms and other not in rt.vms and o.kept.until == {}
    available["mib"] = 1000
    with pytest.raises(CapacityExceeded):  # nothing left to release: refused
        await o.create(CreateRequest())


async def test_no_vm_is_kept_when_disabled_or_in_a_cluster(make, rt) -> None:
    for o in (await make(keep_s=0), await make(handoff=True)):
        sid, _ = await paused(o)
        assert sid not in rt.vms and o.kept.until == {}


async def test_shutdown_releases_kept_vms(make, rt, store) -> None:
    o = await make()
    sid, _ = await paused(o)
    await o.aclose()
    assert sid not in rt.vms
    assert store.get_sandbox(sid).state is S.PAUSED
