"""Recovery decisions for every state, over the runtime double (state-machine logic only).

Each test brings a sandbox to a state with the real orchestrator, then writes the
transitional state a crash would have left (what `transition()` persisted before the
runtime call), and runs recovery against what the runtime double says is alive.
"""

from __future__ import annotations

import pytest

from host.contract import MachineSpec, SnapshotRef
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.model import CreateRequest
from host.orchestrator.records import with_runtime
from host.orchestrator.recovery import recover
from host.orchestrator.states import SandboxState as S

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
async def orch(store, rt, envd):
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    yield o
    await o.aclose()


async def _recover(store, rt, envd):
    client = EnvdClient(transport=envd.transport())
    try:
        return await recover(store, rt, client)
    finally:
        await client.aclose()


async def _running(orch) -> str:
    return (await orch.create(CreateRequest())).sandbox_id


def _crash_into(store, sid, via: list[S], **runtime_changes):
    """Persist the transitions an operation makes before its runtime call."""
    for st in via:
        rec = store.get_sandbox(sid)
        store.transition(sid, {rec.state}, st, runtime=with_runtime(rec, **runtime_changes))


def _commit_snapshot(rt, snap_id):
    rt.snapshots[snap_id] = SnapshotRef(snapshot_id=snap_id, machine=MachineSpec(),
                                        created_at=0.0, parent_id="tmpl-base")


async def test_running_alive_stays_running(orch, store, rt, envd):
    sid = await _running(orch)
    out = await _recover(store, rt, envd)
    assert out == {sid: S.RUNNING}
    assert ("reap_orphans", (frozenset({sid}),)) in rt.calls


async def test_running_dead_without_snapshot_is_killed(orch, store, rt, envd):
    sid = await _running(orch)
    del rt.vms[sid]
    assert await _recover(store, rt, envd) == {sid: S.KILLED}


async def test_running_dead_with_pause_snapshot_is_paused(orch, store, rt, envd):
    sid = await _running(orch)
    await orch.pause(sid)
    await orch.connect(sid, None)
    snap = store.get_sandbox(sid).snapshot_id
    del rt.vms[sid]
    assert await _recover(store, rt, envd) == {sid: S.PAUSED}
    rec = store.get_sandbox(sid)
    assert rec.snapshot_id == snap and rec.end_at is None and rec.ttl_left_s > 0
    assert "placement" not in rec.runtime
    assert (await orch.connect(sid, None))[1] is True  # resumable


async def test_running_dead_with_its_disk_is_paused_on_that_disk(orch, store, rt, envd):
    """Issue 14 item 18: the VM died while the service was down, its disk did not: the
    sandbox is paused on a new disk-only snapshot (resumed by a cold boot), not on its
    last pause (losing what it wrote since) nor killed."""
    sid = await _running(orch)
    await orch.pause(sid)
    await orch.connect(sid, None)
    last = store.get_sandbox(sid).snapshot_id
    del rt.vms[sid]
    rt.disks.add(sid)
    assert await _recover(store, rt, envd) == {sid: S.PAUSED}
    rec = store.get_sandbox(sid)
    assert rec.snapshot_id not in (None, last) and rec.runtime["pause_mode"] == "filesystem"
    assert store.get_snapshot(rec.snapshot_id).kind == "pause"
    rt.reboots.clear()
    assert (await orch.connect(sid, None))[1] is True
    assert rt.reboots == [sid]   # a cold boot of the kept disk


async def test_creating_is_killed(orch, store, rt, envd):
    sid = await _running(orch)
    # a sandbox that was being created: record only, VM half-started
    rec = store.get_sandbox(sid)
    store.delete_sandbox(sid)
    store.insert_sandbox(rec.__class__(**{**rec.__dict__, "state": S.CREATING}))
    assert await _recover(store, rt, envd) == {sid: S.KILLED}
    assert sid not in rt.vms and ("kill", (sid,)) in rt.calls


async def test_pausing_committed_in_store(orch, store, rt, envd):
    sid = await _running(orch)
    await orch.pause(sid)
    snap = store.get_sandbox(sid).snapshot_id
    rec = store.get_sandbox(sid)
    # crash after the snapshot record, before the final transition
    store.transition(sid, {S.PAUSED}, S.RESUMING)
    store.transition(sid, {S.RESUMING}, S.RUNNING, end_at=1e10)
    _crash_into(store, sid, [S.PAUSING], pending={"store_id": snap, "runtime_id": snap,
                                                 "kind": "pause"})
    assert rec.snapshot_id == snap
    assert await _recover(store, rt, envd) == {sid: S.PAUSED}
    assert store.get_sandbox(sid).snapshot_id == snap


async def test_pausing_committed_only_in_runtime(orch, store, rt, envd):
    sid = await _running(orch)
    _crash_into(store, sid, [S.PAUSING], pending={"store_id": "pnew", "runtime_id": "pnew",
                                                 "kind": "pause"})
    _commit_snapshot(rt, "pnew")  # the runtime finished (and stopped the VM)...
    del rt.vms[sid]
    assert await _recover(store, rt, envd) == {sid: S.PAUSED}  # ...the store learns it
    rec = store.get_sandbox(sid)
    assert rec.snapshot_id == "pnew" and store.get_snapshot("pnew").kind == "pause"


async def test_pausing_not_committed_vm_alive_is_running(orch, store, rt, envd):
    sid = await _running(orch)
    _crash_into(store, sid, [S.PAUSING], pending={"store_id": "px", "runtime_id": "px",
                                                 "kind": "pause"})
    assert await _recover(store, rt, envd) == {sid: S.RUNNING}
    assert "pending" not in store.get_sandbox(sid).runtime


async def test_pausing_not_committed_vm_dead_falls_back(orch, store, rt, envd):
    a, b = await _running(orch), await _running(orch)
    await orch.pause(a)
    await orch.connect(a, None)
    prev = store.get_sandbox(a).snapshot_id
    for sid in (a, b):
        _crash_into(store, sid, [S.PAUSING], pending={"store_id": "q" + sid,
                                                     "runtime_id": "q" + sid, "kind": "pause"})
        del rt.vms[sid]
    out = await _recover(store, rt, envd)
    assert out == {a: S.PAUSED, b: S.KILLED}
    assert store.get_sandbox(a).snapshot_id == prev


async def test_resuming(orch, store, rt, envd):
    a, b = await _running(orch), await _running(orch)
    for sid in (a, b):
        await orch.pause(sid)
    # a: the VM came up before the crash; b: it did not
    for sid in (a, b):
        _crash_into(store, sid, [S.RESUMING])
    snap = rt.snapshots[store.get_sandbox(a).snapshot_id]
    await rt.start(a, snap, None)
    inits = len(envd.inits)
    out = await _recover(store, rt, envd)
    assert out == {a: S.RUNNING, b: S.PAUSED}
    assert len(envd.inits) == inits + 1  # /init again, same token
    token = store.get_sandbox(a).envd_token
    assert envd.inits[-1][1]["accessToken"] == token
    assert envd.inits[-1][2]["x-access-token"] == token
    assert store.get_sandbox(a).end_at is not None
    assert store.get_sandbox(b).end_at is None and b not in rt.vms


@pytest.mark.parametrize("via", [S.SNAPSHOTTING, S.FORKING])
async def test_live_snapshot_states(orch, store, rt, envd, via):
    alive, dead_paused, dead = [await _running(orch) for _ in range(3)]
    await orch.pause(dead_paused)
    await orch.connect(dead_paused, None)
    for sid in (alive, dead_paused, dead):
        _crash_into(store, sid, [via], pending={"store_id": "f" + sid, "runtime_id": "f" + sid,
                                               "kind": "fork"})
    _commit_snapshot(rt, "f" + alive)  # written but never recorded: dropped
    del rt.vms[dead_paused], rt.vms[dead]
    out = await _recover(store, rt, envd)
    assert out == {alive: S.RUNNING, dead_paused: S.PAUSED, dead: S.KILLED}
    assert ("delete_snapshot", ("f" + alive,)) in rt.calls


async def test_killing_is_killed_and_orphans_reaped(orch, store, rt, envd):
    sid = await _running(orch)
    _crash_into(store, sid, [S.KILLING])
    rt.vms["iorphan0000000000000000"] = rt.vms[sid]
    out = await _recover(store, rt, envd)
    assert out == {sid: S.KILLED}
    assert rt.vms == {}
    assert ("reap_orphans", (frozenset(),)) in rt.calls


async def test_nothing_transitional_remains(orch, store, rt, envd):
    sids = [await _running(orch) for _ in range(6)]
    for sid, st in zip(sids, [S.PAUSING, S.RESUMING, S.SNAPSHOTTING, S.FORKING, S.KILLING],
                       strict=False):
        if st is S.RESUMING:
            await orch.pause(sid)
        _crash_into(store, sid, [st])
    await _recover(store, rt, envd)
    states = {r.state for r in store.list_sandboxes()}
    assert states <= {S.RUNNING, S.PAUSED, S.KILLED}
    live = {r.id for r in store.list_sandboxes() if r.state is S.RUNNING}
    assert set(rt.vms) == live  # SQLite agrees with the runtime


async def test_adopted_but_stopped_vm_is_paused_with_its_data(orch, store, rt, envd):
    """A VM adopted mid-pause whose vCPUs stay stopped: paused on a fresh snapshot (its
    memory is intact); if even that fails, released and back to its previous snapshot."""
    a, b = await _running(orch), await _running(orch)
    await orch.pause(b)
    await orch.connect(b, None)
    prev = store.get_sandbox(b).snapshot_id
    for sid in (a, b):
        _crash_into(store, sid, [S.PAUSING], pending={"store_id": "z" + sid,
                                                     "runtime_id": "z" + sid, "kind": "pause"})
        envd.stopped_hosts.add(rt.vms[sid].envd_host)
    rt.fail["snapshot"] = lambda sid: sid == b
    out = await _recover(store, rt, envd)
    assert out == {a: S.PAUSED, b: S.PAUSED}
    fresh = store.get_sandbox(a).snapshot_id
    assert fresh not in (None, "z" + a) and store.get_snapshot(fresh).kind == "pause"
    assert ("snapshot", (a, fresh, True)) in rt.calls
    assert store.get_sandbox(b).snapshot_id == prev and rt.vms == {}
