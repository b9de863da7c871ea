"""Failure paths that must leave no state stranded (issue 29 item 4), over the fake
runtime and a real SQLite store: a pause whose memory snapshot fails after its answer, or
whose VM died, ends paused with its disk (never silently running, never running without a
VM); a kill that failed is retried by the TTL loop until the sandbox is gone."""

from __future__ import annotations

import asyncio

import pytest

from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import OperationFailed
from host.orchestrator.model import CreateRequest
from host.orchestrator.records import PUBLIC_PAUSED
from host.orchestrator.states import SandboxState as S

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
async def orch(store, rt, envd):
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)  # ticks are driven by hand below
    yield o
    await o.aclose()


async def _settled(store, sid: str) -> S:
    for _ in range(200):
        state = store.get_sandbox(sid).state
        if state is not S.PAUSING:
            return state
        await asyncio.sleep(0.01)
    return store.get_sandbox(sid).state


async def test_a_pause_whose_memory_fails_after_its_answer_keeps_the_disk(orch, rt, store):
    rt.answer_on_stop = True
    sid = (await orch.create(CreateRequest())).sandbox_id
    rt.fail["snapshot"] = lambda s: rt.memory_flags[-1]  # memory snapshots fail
    await orch.pause(sid)  # answered: the guest is stopped
    assert await _settled(store, sid) is S.PAUSED
    rec = store.get_sandbox(sid)
    assert rec.runtime.get("pause_mode") == "filesystem"
    assert rt.memory_flags[-2:] == [True, False]  # the memory try, then the disk alone
    assert rec.snapshot_id in rt.snapshots and rt.snapshots[rec.snapshot_id].facts == {
        "memory": None}
    last = store.events(sid)[-1].detail
    assert last["op"] == "paused" and "could not be kept" in last["degraded"]
    assert (await orch.get(sid)).state in PUBLIC_PAUSED
    rt.fail.clear()
    info, resumed = await orch.connect(sid, None)  # a filesystem pause resumes by a boot
    assert resumed and info.state is S.RUNNING and rt.reboots[-1] == sid


async def test_a_pause_whose_vm_died_ends_paused_with_its_disk_not_running(orch, rt, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    rt.dead.add(sid)  # the VM is gone: its memory cannot be captured
    rt.fail["snapshot"] = lambda s: rt.memory_flags[-1]
    await orch.pause(sid)  # not answered early (the fake does not call `stopped`)
    assert store.get_sandbox(sid).state is S.PAUSED
    assert store.get_sandbox(sid).runtime.get("pause_mode") == "filesystem"


async def test_a_failed_pause_of_a_live_vm_not_yet_answered_stays_running(orch, rt, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    rt.fail["snapshot"] = lambda s: rt.memory_flags[-1]
    with pytest.raises(OperationFailed):
        await orch.pause(sid)  # the caller is told, and the sandbox runs on
    assert store.get_sandbox(sid).state is S.RUNNING
    assert rt.memory_flags == [True]  # no disk-only fallback: nothing was promised


async def test_a_kill_that_failed_is_retried_until_the_sandbox_is_gone(orch, rt, store):
    sid = (await orch.create(CreateRequest())).sandbox_id
    failures = iter([True, True])
    rt.fail["kill"] = lambda s: next(failures, False)
    with pytest.raises(OperationFailed):
        await orch.kill(sid)
    assert store.get_sandbox(sid).state is S.KILLING
    await orch._ttl.tick()
    await asyncio.sleep(0.05)
    assert store.get_sandbox(sid).state is S.KILLING  # too recent: maybe in progress
    with store.transaction() as db:  # as if the failed kill was a minute ago
        db.execute("UPDATE sandboxes SET updated_at = updated_at - 60 WHERE id = ?", (sid,))
    await orch._ttl.tick()  # the retry fails too: backs off
    await asyncio.sleep(0.05)
    assert store.get_sandbox(sid).state is S.KILLING
    orch._ttl._retry_at.clear()  # the back-off is over
    await orch._ttl.tick()
    for _ in range(100):
        if store.get_sandbox(sid).state is S.KILLED:
            break
        await asyncio.sleep(0.01)
    assert store.get_sandbox(sid).state is S.KILLED
    assert sid not in rt.vms
    assert [c for c in rt.calls if c[0] == "kill"] == [("kill", (sid,))] * 3
