"""Cluster handoffs (host/orchestrator/handoff.py): a sandbox paused on node A is taken
over by node B from the shared repository, resumes there with its identity (id, envd
token, metadata, TTL left), and A forgets its copy without touching the snapshots.

Two real NodeOrchestrators, each with its own SQLite store; their fake runtimes share the
snapshot and handoff dicts as two nodes share one repository. The VM-backed path is in
tests/e2e/test_cluster_handoff.py.
"""

from __future__ import annotations

import pytest

from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import OperationFailed, SandboxNotFound
from host.orchestrator.model import CreateRequest, ListFilter
from host.orchestrator.states import SandboxState as S

from .fakes import Clock, FakeRuntime

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
def clock():
    return Clock()


async def _node(path, rt, envd, clock, *, handoff=True) -> NodeOrchestrator:
    o = NodeOrchestrator(Store(path), rt, domain="sbx.test", clock=clock,
                         envd=EnvdClient(transport=envd.transport()), handoff=handoff)
    await o.start(ttl_interval_s=3600)
    return o


@pytest.fixture
async def nodes(tmp_path, rt, envd, clock):
    rt_b = FakeRuntime()
    rt_b.envd = envd
    rt_b.snapshots = rt.snapshots    # one repository
    rt_b.documents = rt.documents
    rt_b._n = rt._n                   # distinct guest addresses on the two "nodes"
    a = await _node(tmp_path / "a.db", rt, envd, clock)
    b = await _node(tmp_path / "b.db", rt_b, envd, clock)
    yield a, b, rt, rt_b
    for o in (a, b):
        await o.aclose()
        o.store.close()


async def test_a_pause_taken_over_by_another_node(nodes, clock):
    a, b, rt_a, rt_b = nodes
    info = await a.create(CreateRequest(metadata={"owner": "rl"}, timeout_s=600))
    sid = info.sandbox_id
    clock.advance(100)
    rt_a.answer_on_stop = True  # in a cluster the pause still answers once committed:
    await a.pause(sid)
    doc = rt_a.handoffs[sid]    # its handoff is there when the caller has its answer
    assert doc["sandbox"]["state"] == "paused" and "placement" not in doc["sandbox"]["runtime"]

    adopted = await b.adopt(sid)
    assert adopted.state is S.PAUSED and adopted.metadata == {"owner": "rl"}
    assert adopted.envd_access_token == info.envd_access_token
    assert await b.adopt(sid) == adopted  # idempotent
    resumed, was_paused = await b.connect(sid, None)
    assert was_paused and resumed.state is S.RUNNING
    assert resumed.end_at == pytest.approx(clock() + 500)  # the TTL left when it paused
    assert sid in rt_b.vms and sid not in rt_a.vms
    assert sid not in rt_a.handoffs  # running on B: that pause may not be taken again

    assert await a.forget(sid) is True
    with pytest.raises(SandboxNotFound):
        await a.get(sid)
    assert not [c for c in rt_a.calls if c[0] == "delete_snapshot"]  # B's now
    assert [i.sandbox_id for i in await b.list(ListFilter())] == [sid]
    await b.kill(sid)
    assert await a.forget(sid) is False


async def test_adopt_refusals(nodes):
    a, b, rt_a, _ = nodes
    with pytest.raises(SandboxNotFound):
        await b.adopt("inosuchsandbox0000000")
    sid = (await a.create(CreateRequest())).sandbox_id
    with pytest.raises(SandboxNotFound):
        await b.adopt(sid)  # running on A: no handoff
    await a.pause(sid)
    rt_a.snapshots.pop(rt_a.handoffs[sid]["snapshot"]["id"])
    with pytest.raises(OperationFailed, match="not in the repository"):
        await b.adopt(sid)
    rt_a.handoffs[sid]["version"] = 99
    with pytest.raises(OperationFailed, match="another release"):
        await b.adopt(sid)
    with pytest.raises(SandboxNotFound):
        await b.get(sid)  # nothing half-adopted
    assert b.store.list_snapshots() == [] or all(
        s.kind != "pause" for s in b.store.list_snapshots())


async def test_resume_and_kill_withdraw_the_handoff(nodes):
    a, _, rt_a, _ = nodes
    one = (await a.create(CreateRequest())).sandbox_id
    two = (await a.create(CreateRequest())).sandbox_id
    await a.pause(one)
    await a.pause(two)
    assert set(rt_a.handoffs) == {one, two}
    await a.connect(one, None)
    await a.kill(two)
    assert rt_a.handoffs == {}
    await a.pause(one)
    assert set(rt_a.handoffs) == {one}


async def test_a_failed_handoff_does_not_fail_the_pause(nodes):
    a, _, rt_a, _ = nodes
    sid = (await a.create(CreateRequest())).sandbox_id
    rt_a.fail["put_document"] = lambda _: True
    await a.pause(sid)
    assert (await a.get(sid)).state is S.PAUSED and rt_a.handoffs == {}


async def test_a_node_outside_a_cluster_leaves_no_handoff(tmp_path, rt, envd, clock):
    o = await _node(tmp_path / "solo.db", rt, envd, clock, handoff=False)
    try:
        sid = (await o.create(CreateRequest())).sandbox_id
        await o.pause(sid)
        assert rt.handoffs == {}
    finally:
        await o.aclose()
        o.store.close()
