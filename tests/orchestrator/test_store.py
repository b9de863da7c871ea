"""The SQLite store: conditional transitions, durability across reopen, events."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from host.orchestrator.errors import SandboxNotFound, SnapshotNotFound, StateConflict
from host.orchestrator.states import SandboxState as S
from host.orchestrator.store import SandboxRecord, SnapshotRecord, Store


def _rec(sid: str = "sbx1", state: S = S.CREATING) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(id=sid, template_id="base", state=state, cpu_count=1, memory_mb=256,
                         disk_mb=1024, started_at=now, end_at=now + 300,
                         metadata={"k": "v"}, env_vars={"A": "1"}, runtime={"pid": 1})


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


def test_insert_get_roundtrip(store):
    store.insert_sandbox(_rec())
    got = store.get_sandbox("sbx1")
    assert got.state is S.CREATING
    assert got.metadata == {"k": "v"} and got.env_vars == {"A": "1"} and got.runtime == {"pid": 1}
    assert got.auto_pause is True


def test_unknown_sandbox(store):
    with pytest.raises(SandboxNotFound):
        store.get_sandbox("nope")
    with pytest.raises(SandboxNotFound):
        store.transition("nope", {S.RUNNING}, S.PAUSING)


def test_transition_conflict_names_states(store):
    store.insert_sandbox(_rec(state=S.RUNNING))
    store.transition("sbx1", {S.RUNNING}, S.PAUSING)
    store.transition("sbx1", {S.PAUSING}, S.PAUSED, end_at=None, ttl_left_s=120.0)
    with pytest.raises(StateConflict) as ei:
        store.transition("sbx1", {S.RUNNING}, S.PAUSING)
    assert ei.value.actual is S.PAUSED
    assert "paused" in str(ei.value) and "running" in str(ei.value)
    assert store.get_sandbox("sbx1").ttl_left_s == 120.0


def test_illegal_move_is_rejected_even_if_expected_matches(store):
    store.insert_sandbox(_rec(state=S.PAUSED))
    with pytest.raises(StateConflict):
        store.transition("sbx1", {S.PAUSED}, S.FORKING)
    assert store.get_sandbox("sbx1").state is S.PAUSED


def test_events_recorded_in_order(store):
    store.insert_sandbox(_rec())
    store.transition("sbx1", {S.CREATING}, S.RUNNING)
    store.transition("sbx1", {S.RUNNING}, S.KILLING)
    kinds = [e.kind for e in store.events("sbx1")]
    assert kinds == ["creating", "running", "killing"]
    ts = [e.ts for e in store.events("sbx1")]
    assert ts == sorted(ts)


def _writer(path: str, ready) -> None:
    s = Store(path)
    s.insert_sandbox(_rec())
    s.transition("sbx1", {S.CREATING}, S.RUNNING)
    ready.set()
    time.sleep(60)


def test_transition_durable_after_sigkill(tmp_path):
    """A transition that returned is on disk even if the process dies right after."""
    path = str(tmp_path / "state.db")
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_writer, args=(path, ready))
    p.start()
    assert ready.wait(10)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    s = Store(path)
    try:
        assert s.get_sandbox("sbx1").state is S.RUNNING
    finally:
        s.close()


def test_snapshots(store):
    store.insert_snapshot(SnapshotRecord(id="team/snap:default", kind="named", created_at=1.0,
                                         sandbox_id="sbx1", spec={"memory_mb": 256}))
    assert store.get_snapshot("team/snap:default").spec == {"memory_mb": 256}
    assert [s.id for s in store.list_snapshots(sandbox_id="sbx1")] == ["team/snap:default"]
    store.delete_snapshot("team/snap:default")
    with pytest.raises(SnapshotNotFound):
        store.delete_snapshot("team/snap:default")


def test_idempotency_key(store):
    assert store.claim_idempotency_key("k1", "req") == (True, None, "req")
    store.bind_idempotency_key("k1", "sbx9")
    assert store.claim_idempotency_key("k1", "req") == (False, "sbx9", "req")


async def test_async_run(store):
    store.insert_sandbox(_rec(state=S.RUNNING))
    rec = await store.run(store.transition, "sbx1", {S.RUNNING}, S.KILLING)
    assert rec.state is S.KILLING
