"""The node's collector (host/orchestrator/collector.py) and the disk floor over the fake
runtime and a real SQLite store: killed sandboxes' records go after their retention and
nothing else does; a dry run removes nothing; a start under the disk floor is refused with
507 and `insufficient_storage`, and the node's health says why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from host.api.errors import response_for
from host.orchestrator import NodeOrchestrator
from host.orchestrator.admission import AdmissionPolicy
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import OutOfDisk, SandboxNotFound
from host.orchestrator.model import CreateRequest
from host.orchestrator.states import SandboxState as S

from .fakes import Clock

on_loop = pytest.mark.asyncio(loop_scope="function")
DAY = 86400.0


@on_loop
async def test_killed_records_go_after_their_retention_and_live_ones_stay(store, rt, envd):
    clock = Clock()
    o = NodeOrchestrator(store, rt, domain="sbx.test", clock=clock, retain_killed_s=DAY,
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    try:
        old = [await o.create(CreateRequest()) for _ in range(3)]
        for info in old:
            await o.kill(info.sandbox_id)
        # records' update times are the store's wall clock: age them by hand
        with store.transaction() as db:
            db.execute("UPDATE sandboxes SET updated_at = updated_at - ? WHERE state = ?",
                       (2 * DAY, S.KILLED.value))
        recent = await o.create(CreateRequest())
        await o.kill(recent.sandbox_id)
        alive = await o.create(CreateRequest())
        clock.t = store.get_sandbox(alive.sandbox_id).updated_at  # the wall clock's now
        events_before = len(store.events())

        dry = await o.collect(dry_run=True)
        assert dry["dry_run"] and dry["records"]["sandboxes"] == 3
        assert dry["records"]["events"] > 0
        assert len(store.list_sandboxes()) == 5  # a dry run deletes nothing

        report = await o.collect()
        assert report["records"]["sandboxes"] == 3
        assert report["records"]["events"] == dry["records"]["events"]
        assert len(store.events()) == events_before - report["records"]["events"]
        assert {r.id for r in store.list_sandboxes()} == {recent.sandbox_id, alive.sandbox_id}
        for info in old:
            with pytest.raises(SandboxNotFound):
                await o.get(info.sandbox_id)
        assert (await o.get(alive.sandbox_id)).state is S.RUNNING
        assert ("collect_storage", (False,)) in rt.calls
        samples = {(s.name, s.labels.get("kind")): s.value
                   for metric in o.service_metrics.registry.collect()
                   for s in metric.samples}
        assert samples[("aenv_gc_records_total", "sandboxes")] == 3
    finally:
        await o.aclose()


@on_loop
async def test_the_periodic_collector_runs_on_its_own(store, rt, envd):
    o = NodeOrchestrator(store, rt, domain="sbx.test", gc_interval_s=0.05,
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    try:
        for _ in range(200):
            if len(rt.ops("collect_storage")) >= 2:
                break
            await asyncio.sleep(0.02)
        assert len(rt.ops("collect_storage")) >= 2
        assert o.collector.last is not None and not o.collector.last["dry_run"]
    finally:
        await o.aclose()
    n = len(rt.ops("collect_storage"))
    await asyncio.sleep(0.15)
    assert len(rt.ops("collect_storage")) == n  # stopped with the orchestrator


@on_loop
async def test_a_start_under_the_disk_floor_is_refused_with_507(store, rt, envd, tmp_path: Path):
    free = {"mib": 100}
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         admission=AdmissionPolicy(disk_path=tmp_path, min_free_disk_mib=500),
                         envd=EnvdClient(transport=envd.transport()))
    o._ctx.admission._free_disk_mib = lambda path: free["mib"]
    await o.start(ttl_interval_s=3600)
    try:
        assert o.health() and "100 MiB free" in o.health()[0]
        with pytest.raises(OutOfDisk, match="nearly full") as err:
            await o.create(CreateRequest())
        resp = response_for(err.value)
        assert resp.status_code == 507 and resp.headers["Should-Retry"] == "false"
        assert b'"error_code":"insufficient_storage"' in resp.body
        assert not rt.vms  # nothing was started
        assert all(r.state is S.KILLED for r in store.list_sandboxes())
        free["mib"] = 800
        assert o.health() == []
        assert (await o.create(CreateRequest())).state is S.RUNNING
    finally:
        await o.aclose()


def test_the_real_free_space_of_a_directory_is_read(tmp_path: Path) -> None:
    from host.orchestrator.admission import Admission
    adm = Admission(AdmissionPolicy(disk_path=tmp_path, min_free_disk_mib=1 << 40))
    assert "below its floor" in (adm.disk_problem() or "")
    assert Admission(AdmissionPolicy(disk_path=tmp_path, min_free_disk_mib=1)).disk_problem() is None


@on_loop
async def test_a_live_sandbox_keeps_only_its_last_pause(store, rt, envd):
    """Paused and resumed many times, a sandbox keeps the pause it resumes from (and
    what a named snapshot builds on); its earlier pauses' records and runtime snapshots
    go (their files stay while a later manifest names them: runtime/collect.py)."""
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    try:
        sid = (await o.create(CreateRequest())).sandbox_id
        for _ in range(5):
            await o.pause(sid)
            await o.connect(sid, None)
        named = await o.snapshot(sid, "keepme")  # its parent: the pause it resumed from
        for _ in range(3):
            await o.pause(sid)
            await o.connect(sid, None)
        pauses = [s.id for s in store.list_snapshots(sandbox_id=sid) if s.kind == "pause"]
        assert len(pauses) == 8
        dry = await o.collect(dry_run=True)  # counts them, deletes none
        assert dry["records"]["snapshots"] == 6 and not rt.ops("delete_snapshot")
        assert len([s for s in store.list_snapshots(sandbox_id=sid) if s.kind == "pause"]) == 8
        report = await o.collect()
        left = {s.id for s in store.list_snapshots(sandbox_id=sid) if s.kind == "pause"}
        current = store.get_sandbox(sid).snapshot_id
        named_parent = store.get_snapshot(named.snapshot_id).parent_id
        assert left == {current, named_parent}
        assert report["records"]["snapshots"] == 6
        deleted = {args[0] for args in rt.ops("delete_snapshot")}
        assert current not in deleted and named_parent not in deleted and len(deleted) >= 6
        info, resumed = await o.connect(sid, None)  # running: nothing to do
        await o.pause(sid)
        info, resumed = await o.connect(sid, None)  # resumes from the newest pause
        assert resumed and info.state is S.RUNNING
    finally:
        await o.aclose()
