"""The cluster's template catalog (host/orchestrator/templates/catalog.py): a template built on node
A, or a named snapshot taken there, starts sandboxes on node B; B follows A's tag moves
and deletes, never changes A's tags and never deletes A's files.

Two real NodeOrchestrators, each with its own SQLite store; their fake runtimes share the
snapshot and document dicts as two nodes share one repository. The VM-backed path is in
tests/e2e/test_cluster.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from host.contract import BuildStep
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import InvalidRequest, SnapshotNotFound, TemplateNotFound
from host.orchestrator.model import BuildStatus, CreateRequest, RequestedBuild

from .fakes import FakeRuntime
from .templating import build, run

pytestmark = pytest.mark.asyncio(loop_scope="function")

GUEST_STEPS = (BuildStep(type="ENV", args=("A", "tpl")),
               BuildStep(type="WORKDIR", args=("/app",)))


async def _node(path, rt, envd, *, cluster=True) -> NodeOrchestrator:
    o = NodeOrchestrator(Store(path), rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()), handoff=cluster)
    await o.start(ttl_interval_s=3600)
    return o


def _pair(rt, envd) -> FakeRuntime:
    rt_b = FakeRuntime()
    rt_b.envd = envd
    rt_b.snapshots = rt.snapshots    # one repository
    rt_b.documents = rt.documents
    rt_b.build_specs = rt.build_specs
    rt_b._n = rt._n
    return rt_b


@pytest.fixture
async def nodes(tmp_path, rt, envd):
    rt_b = _pair(rt, envd)
    a = await _node(tmp_path / "a.db", rt, envd)
    b = await _node(tmp_path / "b.db", rt_b, envd)
    yield a, b, rt, rt_b
    for o in (a, b):
        await o.aclose()
        o.store.close()


async def built(o: NodeOrchestrator, rt: FakeRuntime, name: str, **kw: Any
                ) -> tuple[RequestedBuild, BuildStatus]:
    """build() on `o`, then until `o` published it: right after the build reads ready
    (builds._succeed), so a test that saw it ready may not see it published yet."""
    req, st = await build(o, name, **kw)

    def published() -> bool:
        doc = rt.documents.get(f"template-{req.template_id}") or {}
        return (f"alias-{name}" in rt.documents
                and any(b["id"] == req.build_id for b in doc.get("builds", ())))

    async with asyncio.timeout(5):
        while not published():
            await asyncio.sleep(0.005)
    return req, st


def _deleted(rt: FakeRuntime) -> set[str]:
    return {args[0] for op, args in rt.calls if op == "delete_snapshot"}


async def test_a_template_built_on_one_node_starts_sandboxes_on_another(nodes, envd):
    a, b, rt_a, rt_b = nodes
    req, st = await built(a, rt_a, "app", steps=GUEST_STEPS)
    assert st.status == "ready"
    assert rt_a.documents["alias-app"] == {"templateId": req.template_id}
    snap = rt_a.build_specs[0].snapshot_id
    for ref in ("app", "app:default", "aenv/app", req.template_id):
        info = await b.create(CreateRequest(template_id=ref))
        assert (info.template_id, info.alias) == (req.template_id, "app")
        assert ("start", (info.sandbox_id, snap)) in rt_b.calls
        _, body, _ = envd.inits[-1]
        assert body["defaultWorkdir"] == "/app" and body["envVars"] == {"A": "tpl"}
    got = await b.get_template("app")
    assert got.template_id == req.template_id and got.aliases == ("app",)
    assert [t.template_id for t in await b.list_templates()] == [req.template_id]
    assert await b.template_alias("app") == (req.template_id, False)
    # a build from it on B (fromTemplate) starts from A's snapshot
    _, st = await build(b, "child", steps=run("echo 2"), from_template="app")
    assert st.status == "ready" and rt_b.build_specs[-1].from_snapshot == snap


async def test_b_follows_moved_tags_and_leaves_them_to_the_home_node(nodes):
    a, b, rt_a, rt_b = nodes
    await built(a, rt_a, "app", steps=run("echo 1"))
    first = rt_a.build_specs[0].snapshot_id
    assert ("start", ((await b.create(CreateRequest(template_id="app"))).sandbox_id,
                      first)) in rt_b.calls
    await a.assign_tags("app:default", ["v1"])
    await built(a, rt_a, "app", steps=run("echo 2"))   # default moves to the new build
    second = rt_a.build_specs[1].snapshot_id
    info = await b.create(CreateRequest(template_id="app"))
    assert ("start", (info.sandbox_id, second)) in rt_b.calls
    info = await b.create(CreateRequest(template_id="app:v1"))
    assert ("start", (info.sandbox_id, first)) in rt_b.calls
    with pytest.raises(TemplateNotFound):   # B holds a copy: A moves the tags
        await b.assign_tags("app:default", ["mine"])
    with pytest.raises(TemplateNotFound):
        await b.remove_tags("app", ["v1"])
    assert {t.tag for t in await a.list_tags("app")} == {"default", "v1"}


async def test_deleted_at_home_is_dropped_elsewhere_and_b_never_deletes_a_files(nodes):
    a, b, rt_a, rt_b = nodes
    req, _ = await built(a, rt_a, "app")
    snap = rt_a.build_specs[0].snapshot_id
    sbx = await b.create(CreateRequest(template_id="app"))
    with pytest.raises(InvalidRequest, match="used by 1 sandbox"):  # B's user counts on B
        await b.delete_template("app")
    await b.kill(sbx.sandbox_id)
    await b.delete_template("app")        # B's copy only
    assert snap in rt_a.snapshots and f"template-{req.template_id}" in rt_a.documents
    assert snap not in _deleted(rt_b)
    await b.create(CreateRequest(template_id="app"))   # imported again on demand
    await a.delete_template("app")   # at home: withdrawn; B has a user, A has none
    assert f"template-{req.template_id}" not in rt_a.documents
    assert "alias-app" not in rt_a.documents
    with pytest.raises(SnapshotNotFound):    # B's next lookup drops its copy
        await b.create(CreateRequest(template_id="app"))
    assert await b.list_templates() == [] and snap not in _deleted(rt_b)


async def test_a_named_snapshot_starts_sandboxes_on_another_node(nodes):
    a, b, rt_a, rt_b = nodes
    sbx = await a.create(CreateRequest())
    snap = await a.snapshot(sbx.sandbox_id, "snappy")
    info = await b.create(CreateRequest(template_id=snap.snapshot_id))
    assert info.template_id == snap.snapshot_id
    assert await b.list_snapshots(None, None) == []   # listed by its own node only
    assert [s.snapshot_id for s in await a.list_snapshots(None, None)] == [snap.snapshot_id]
    await b.kill(info.sandbox_id)
    await a.delete_template(snap.snapshot_id)
    assert _deleted(rt_a) and not _deleted(rt_a) & _deleted(rt_b)   # A's files, by A only
    with pytest.raises(SnapshotNotFound):
        await b.create(CreateRequest(template_id=snap.snapshot_id))


async def test_outside_a_cluster_nothing_is_shared(tmp_path, rt, envd):
    rt_b = _pair(rt, envd)
    a = await _node(tmp_path / "a.db", rt, envd, cluster=False)
    b = await _node(tmp_path / "b.db", rt_b, envd, cluster=False)
    try:
        await build(a, "app")
        sbx = await a.create(CreateRequest())
        snap = await a.snapshot(sbx.sandbox_id, "snappy")
        assert rt.documents == {}
        for ref in ("app", snap.snapshot_id):
            with pytest.raises(SnapshotNotFound):
                await b.create(CreateRequest(template_id=ref))
    finally:
        for o in (a, b):
            await o.aclose()
            o.store.close()
