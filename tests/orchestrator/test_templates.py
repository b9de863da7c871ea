"""Built templates over the fake runtime: sandboxes started from them (by id, name, tag)
with their guest defaults sent to envd /init, listing, aliases, tags, deletion and the
release of unused snapshots, COPY uploads, and an older database gaining the template
tables. No VM runs (tests/orchestrator/fakes.py)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time

import pytest

from host.contract import BuildStep
from host.orchestrator import NodeOrchestrator, Store
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import (
    InvalidRequest,
    SnapshotNotFound,
    TemplateNotFound,
    UploadTooLarge,
)
from host.orchestrator.model import BuildRequest, CreateRequest
from host.orchestrator.states import SandboxState as S
from host.orchestrator.store import SandboxRecord

from .templating import build, chunks, files_hash, run, upload

pytestmark = pytest.mark.asyncio(loop_scope="function")

GUEST_STEPS = (BuildStep(type="ENV", args=("A", "tpl", "B", "tpl")),
               BuildStep(type="WORKDIR", args=("/app",)), BuildStep(type="USER", args=("root",)))


@pytest.fixture
async def orch(store, rt, envd):
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    yield o
    await o.aclose()


# ---- sandboxes from built templates --------------------------------------------------

async def test_create_from_a_built_template_sends_its_guest_defaults(orch, rt, envd):
    req, _ = await build(orch, "app", steps=GUEST_STEPS)
    spec = rt.build_specs[0]
    for ref in ("app", "app:default", "aenv/app", req.template_id, "APP"):
        info = await orch.create(CreateRequest(template_id=ref, env_vars={"B": "mine"}))
        assert (info.template_id, info.alias) == (req.template_id, "app")
        assert ("start", (info.sandbox_id, spec.snapshot_id)) in rt.calls
        _, body, _ = envd.inits[-1]
        assert body["defaultUser"] == "root" and body["defaultWorkdir"] == "/app"
        assert body["envVars"] == {"A": "tpl", "B": "mine"}  # the create's env wins
    tmpl = await orch.get_template("app")
    assert tmpl.spawn_count == 5 and tmpl.last_spawned_at is not None


async def test_the_default_template_is_unchanged(orch, envd):
    await build(orch, "app", steps=GUEST_STEPS)
    for ref in ("base", "default", ""):
        info = await orch.create(CreateRequest(template_id=ref, env_vars={"X": "1"}))
        assert (info.template_id, info.alias) == ("base", "base")
        _, body, _ = envd.inits[-1]
        assert (body["defaultUser"], body["defaultWorkdir"], body["envVars"]) == (
            "user", "/home/user", {"X": "1"})


async def test_create_by_tag_and_unknown_tags(orch, rt):
    await build(orch, "app:v1", steps=run("echo one"))
    await build(orch, "app", steps=run("echo two"))
    one, two = rt.build_specs
    info = await orch.create(CreateRequest(template_id="app:v1"))
    assert ("start", (info.sandbox_id, one.snapshot_id)) in rt.calls
    info = await orch.create(CreateRequest(template_id="app"))
    assert ("start", (info.sandbox_id, two.snapshot_id)) in rt.calls
    with pytest.raises(TemplateNotFound, match="no build tagged 'v9'"):
        await orch.create(CreateRequest(template_id="app:v9"))
    with pytest.raises(SnapshotNotFound):
        await orch.create(CreateRequest(template_id="other/app"))


async def test_resume_and_fork_keep_the_guest_defaults(orch, envd):
    await build(orch, "app", steps=GUEST_STEPS)
    sbx = await orch.create(CreateRequest(template_id="app"))
    await orch.pause(sbx.sandbox_id)
    await orch.connect(sbx.sandbox_id, 60)
    _, body, _ = envd.inits[-1]
    assert (body["defaultUser"], body["defaultWorkdir"]) == ("root", "/app")
    (child,) = await orch.fork(sbx.sandbox_id, 1, None)
    assert child.sandbox is not None
    _, body, _ = envd.inits[-1]
    assert (body["defaultUser"], body["envVars"]) == ("root", {"A": "tpl", "B": "tpl"})


async def test_a_template_built_from_a_built_template(orch, rt):
    await build(orch, "parent", steps=GUEST_STEPS)
    _, st = await build(orch, "child", from_template="parent", steps=run("echo hi"))
    assert st.status == "ready"
    parent, child = rt.build_specs
    assert child.from_snapshot == parent.snapshot_id
    assert rt.snapshots[child.snapshot_id].facts["guest"]["user"] == "root"  # inherited


# ---- list, get, aliases --------------------------------------------------------------

async def test_list_and_get(orch):
    assert await orch.list_templates() == []
    first, _ = await build(orch, "app", steps=run("echo 1"))
    second, _ = await build(orch, "app:v2", steps=run("exit 1"))
    (info,) = await orch.list_templates()
    assert info.template_id == first.template_id and info.aliases == ("app",)
    assert info.names == ("aenv/app",) and info.build_count == 2
    assert info.build.build_id == second.build_id and info.build.status == "error"
    assert info.envd_version == "0.6.13" and info.builds == ()
    got = await orch.get_template(first.template_id)
    assert [b.build_id for b in got.builds] == [second.build_id, first.build_id]
    assert got.builds[1].finished_at is not None
    with pytest.raises(TemplateNotFound):
        await orch.get_template("nope")


async def test_alias_lookup(orch):
    req, _ = await build(orch, "app")
    assert await orch.template_alias("base") == ("base", True)
    assert await orch.template_alias("app") == (req.template_id, False)
    assert await orch.template_alias("aenv/app:default") == (req.template_id, False)
    with pytest.raises(TemplateNotFound, match="with tag 'v1' not found"):
        await orch.template_alias("app:v1")
    with pytest.raises(TemplateNotFound, match="Alias 'nope' not found"):
        await orch.template_alias("nope")
    with pytest.raises(InvalidRequest):
        await orch.template_alias("someone/app")


# ---- tags ----------------------------------------------------------------------------

async def test_assign_list_remove_tags(orch):
    req, _ = await build(orch, "app")
    build_id, tags = await orch.assign_tags("app", ["Prod", "v1", "prod"])
    assert (build_id, tags) == (req.build_id, ["prod", "v1"])
    assert {t.tag: t.build_id for t in await orch.list_tags("app")} == {
        "default": req.build_id, "prod": req.build_id, "v1": req.build_id}
    await orch.remove_tags("app", ["v1"])
    assert {t.tag for t in await orch.list_tags(req.template_id)} == {"default", "prod"}
    with pytest.raises(InvalidRequest, match="'default' tag cannot be removed"):
        await orch.remove_tags("app", ["default"])
    with pytest.raises(InvalidRequest, match="must not carry a tag"):
        await orch.remove_tags("app:prod", ["prod"])
    with pytest.raises(TemplateNotFound, match="with tag 'nope' not found"):
        await orch.remove_tags("app", ["nope"])
    with pytest.raises(TemplateNotFound, match="with tag 'v9' not found"):
        await orch.assign_tags("app:v9", ["x"])
    with pytest.raises(InvalidRequest, match="must not be empty"):
        await orch.assign_tags("app", [])


async def test_moved_tags_release_unused_snapshots(orch, rt, store):
    await build(orch, "app", steps=run("echo 1"))
    old = rt.build_specs[0].snapshot_id
    sbx = await orch.create(CreateRequest(template_id="app"))
    await orch.pause(sbx.sandbox_id)
    await build(orch, "app", steps=run("echo 2"))  # default moves to the new build
    async with asyncio.timeout(5):  # marked just after the new build turned ready
        while not store.get_snapshot(old).spec.get("orphaned"):
            await asyncio.sleep(0.01)
    assert old in rt.snapshots  # the paused sandbox still needs it
    await orch.kill(sbx.sandbox_id)
    assert old not in rt.snapshots and ("delete_snapshot", (old,)) in rt.calls
    with pytest.raises(SnapshotNotFound):
        store.get_snapshot(old)
    assert rt.build_specs[1].snapshot_id in rt.snapshots


# ---- delete --------------------------------------------------------------------------

async def test_delete_refused_while_used_then_releases_everything(orch, rt, store):
    req, _ = await build(orch, "app")
    snap = rt.build_specs[0].snapshot_id
    sbx = await orch.create(CreateRequest(template_id="app"))
    with pytest.raises(InvalidRequest, match="used by 1 sandbox"):
        await orch.delete_template("app")
    await orch.kill(sbx.sandbox_id)
    await orch.delete_template(req.template_id)
    assert snap not in rt.snapshots
    with pytest.raises(TemplateNotFound):
        await orch.get_template("app")
    with pytest.raises(SnapshotNotFound):
        await orch.create(CreateRequest(template_id="app"))
    assert await orch.list_templates() == []
    again, _ = await build(orch, "app")  # the name is free again
    assert again.template_id != req.template_id


async def test_delete_falls_back_to_named_snapshots(orch):
    sbx = await orch.create(CreateRequest())
    snap = await orch.snapshot(sbx.sandbox_id, "snappy")
    await orch.delete_template(snap.snapshot_id)
    assert await orch.list_snapshots(None, None) == []
    with pytest.raises(SnapshotNotFound):
        await orch.delete_template("nothing")


# ---- uploads -------------------------------------------------------------------------

async def test_uploads(orch, store):
    req, _ = await build(orch, "app")
    h = files_hash("x")
    assert await orch.template_file(req.template_id, h) is False
    assert await orch.put_template_file(h, chunks(b"ab", b"cd"), max_bytes=4) == 4
    assert await orch.template_file("app", h) is True
    files = store.path.parent / "template-files"
    assert (files / h).read_bytes() == b"abcd" and [p.name for p in files.iterdir()] == [h]
    with pytest.raises(UploadTooLarge):
        await orch.put_template_file(files_hash("big"), chunks(b"abc", b"de"), max_bytes=4)

    async def broken():
        yield b"some"
        raise ConnectionError("client went away")
    with pytest.raises(ConnectionError):
        await orch.put_template_file(files_hash("cut"), broken(), max_bytes=100)
    assert [p.name for p in files.iterdir()] == [h]  # nothing partial left
    with pytest.raises(InvalidRequest, match="Invalid files hash"):
        await orch.template_file("app", "abc")
    with pytest.raises(TemplateNotFound):
        await orch.template_file("nope", h)
    (files / h).unlink()  # recorded but gone: not present
    assert await orch.template_file("app", h) is False


async def test_upload_is_used_by_a_copy_step(orch, rt):
    h = await upload(orch, b"tar")
    _, st = await build(orch, "app", steps=(BuildStep(type="COPY", args=("a", "/b"),
                                                      files_hash=h),))
    assert st.status == "ready" and rt.build_specs[0].steps[0].files_hash == h


# ---- an older database ---------------------------------------------------------------

async def test_an_older_database_gains_the_template_tables(tmp_path, rt, envd):
    path = tmp_path / "old.db"
    old = Store(path)  # a database written before templates existed: no template tables
    old.insert_sandbox(SandboxRecord(id="iold", template_id="base", state=S.PAUSED,
                                     cpu_count=1, memory_mb=256, disk_mb=1024,
                                     started_at=1.0, end_at=None, snapshot_id=None))
    old.close()
    tables = {r[0] for r in sqlite3.connect(path).execute(
        "SELECT name FROM sqlite_master WHERE type='table'")}
    assert "templates" not in tables
    store = Store(path)
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    try:
        assert store.get_sandbox("iold").state is S.PAUSED
        req, st = await build(o, "app")
        assert st.status == "ready"
    finally:
        await o.aclose()
        store.close()
    store = Store(path)  # and the builds survive a reopen
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    try:
        assert (await o.get_template("app")).template_id == req.template_id
    finally:
        await o.aclose()
        store.close()


async def test_copy_archives_unused_past_their_ttl_are_collected(orch, store):
    """An archive goes once unused for `files_ttl_s` (the SDK then uploads it again); an
    ask or a build's use keeps it; nothing goes while a build waits; a dry run only
    counts."""
    await build(orch, "app")
    files = store.path.parent / "template-files"
    old, used, fresh = (await upload(orch, b"old"), await upload(orch, b"used"),
                        await upload(orch, b"fresh"))
    day_ago = time.time() - 86400
    with store.transaction() as db:
        db.execute("UPDATE template_files SET created_at = ? WHERE hash IN (?, ?)",
                   (day_ago, old, used))
    for h in (old, used):
        os.utime(files / h, (day_ago, day_ago))
    assert await orch.template_file("app", used) is True  # the SDK asks: a use
    orch.collector.files_ttl_s = 3600
    dry = await orch.collect(dry_run=True)
    assert dry["storage"]["copy_archives"]["digests"] == [old]
    assert (files / old).exists()
    waiting = await orch.request_build(BuildRequest(name="pending"))  # waits for its start
    held = await orch.collect()
    assert held["storage"]["copy_archives"]["files"] == 0 and (files / old).exists()
    await orch.delete_template(waiting.template_id)
    report = await orch.collect()
    assert report["storage"]["copy_archives"] == {"files": 1, "bytes": 3, "digests": [old]}
    assert sorted(p.name for p in files.iterdir()) == sorted([used, fresh])
    assert await orch.template_file("app", old) is False  # the SDK uploads it again
    with pytest.raises(InvalidRequest, match="never uploaded"):  # a build says so
        await build(orch, "app", steps=(BuildStep(type="COPY", args=("a", "/a"),
                                                  files_hash=old),))
    assert await orch.put_template_file(old, chunks(b"old"), max_bytes=10) == 3
    assert await orch.template_file("app", old) is True
