"""Template builds over the fake runtime: naming and conflicts, validation of a build start,
the build task (logs, success, BuildFailed, other failures), per-template queueing and
recovery of builds interrupted by a restart. No VM runs (tests/orchestrator/fakes.py)."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from host.contract import BuildFailed, BuildStep, MachineSpec, RegistryAuth, SnapshotRef
from host.orchestrator import NodeOrchestrator
from host.orchestrator.envd import EnvdClient
from host.orchestrator.errors import (
    AliasConflict,
    AliasTaken,
    BuildNotFound,
    InvalidRequest,
    TemplateNotFound,
)
from host.orchestrator.model import BuildRequest, BuildStart, CreateRequest
from host.orchestrator.templates.builds import INTERNAL, INTERRUPTED
from host.orchestrator.templates.store import LogRecord, TemplateStore

from .templating import build, files_hash, run, upload, wait_build

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture
async def orch(store, rt, envd):
    o = NodeOrchestrator(store, rt, domain="sbx.test",
                         envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    yield o
    await o.aclose()


# ---- request -------------------------------------------------------------------------

async def test_request_parses_the_name_and_reuses_the_template(orch):
    a = await orch.request_build(BuildRequest(name="  My-Tpl:V1 ", tags=("x", "v1")))
    assert re.fullmatch(r"[a-z0-9]{20}", a.template_id)
    assert str(uuid.UUID(a.build_id)) == a.build_id
    assert a.tags == ("v1", "x") and a.aliases == ("my-tpl",) and a.names == ("aenv/my-tpl",)
    assert a.public is False
    b = await orch.request_build(BuildRequest(name="aenv/my-tpl:default"))
    assert b.template_id == a.template_id and b.build_id != a.build_id
    assert b.tags == ("default",)
    st = await orch.build_status(a.template_id, a.build_id)
    assert st.status == "waiting" and st.entries == ()


@pytest.mark.parametrize("name", ["", "other/my-tpl", "bad name", "a:b:c",
                                  f"x:{uuid.uuid4()}", "x" * 129])
async def test_request_rejects_bad_names(orch, name):
    with pytest.raises(InvalidRequest):
        await orch.request_build(BuildRequest(name=name))


async def test_request_conflicts(orch):
    with pytest.raises(AliasTaken, match="Alias 'base' already used"):
        await orch.request_build(BuildRequest(name="base"))
    first = await orch.request_build(BuildRequest(name="one"))
    with pytest.raises(AliasConflict, match=f"Alias '{first.template_id}' is already used"):
        await orch.request_build(BuildRequest(name=first.template_id))
    with pytest.raises(InvalidRequest):
        await orch.request_build(BuildRequest(name="two", tags=("bad tag",)))


async def test_request_conflicts_with_a_named_snapshot(orch):
    sbx = await orch.create(CreateRequest())
    await orch.snapshot(sbx.sandbox_id, "snappy")
    with pytest.raises(AliasConflict, match="snapshot 'snappy:default'"):
        await orch.request_build(BuildRequest(name="snappy"))
    await orch.request_build(BuildRequest(name="tpl"))
    with pytest.raises(AliasConflict, match="'tpl' is already the name of a template"):
        await orch.snapshot(sbx.sandbox_id, "aenv/tpl:v2")


# ---- start: validation ---------------------------------------------------------------

@pytest.mark.parametrize(("steps", "message"), [
    ((BuildStep(type="FROB", args=("x",)),), "step 1: command type 'FROB' is not implemented"),
    ((BuildStep(type="RUN", args=("ok",)), BuildStep(type="COPY", args=("a", "/b"))),
     r"step 2 \(COPY\): 'filesHash' is required"),
    ((BuildStep(type="COPY", args=("a", "/b"), files_hash=files_hash("never")),),
     r"step 1 \(COPY a\): the files '[0-9a-f]{64}' were never uploaded"),
    ((BuildStep(type="COPY", args=("a", "/b"), files_hash="nothex"),), "invalid filesHash"),
    ((BuildStep(type="ENV", args=("A", "1", "B")),), r"step 1 \(ENV\): needs key/value pairs"),
    ((BuildStep(type="WORKDIR", args=()),), r"step 1 \(WORKDIR\)"),
    ((BuildStep(type="RUN", args=()),), r"step 1 \(RUN\)"),
])
async def test_start_rejects_bad_steps_and_the_build_stays_waiting(orch, rt, steps, message):
    req = await orch.request_build(BuildRequest(name="v"))
    with pytest.raises(InvalidRequest, match=message):
        await orch.start_build(req.template_id, req.build_id,
                               BuildStart(from_template="base", steps=steps))
    assert rt.build_specs == []
    assert (await orch.build_status(req.template_id, req.build_id)).status == "waiting"
    await orch.start_build(req.template_id, req.build_id, BuildStart(from_template="base"))
    assert (await wait_build(orch, req.template_id, req.build_id)).status == "ready"


@pytest.mark.parametrize(("start", "message"), [
    (BuildStart(), "exactly one of 'fromImage' and 'fromTemplate'"),
    (BuildStart(from_image="alpine", from_template="base"), "exactly one of"),
    (BuildStart(from_template="nope"), "fromTemplate 'nope'"),
    (BuildStart(from_template="base", registry=RegistryAuth("u", "p")),
     "'fromImageRegistry' needs 'fromImage'"),
])
async def test_start_rejects_bad_sources(orch, start, message):
    req = await orch.request_build(BuildRequest(name="v"))
    with pytest.raises(InvalidRequest, match=message):
        await orch.start_build(req.template_id, req.build_id, start)


async def test_start_from_a_sandbox_snapshot_is_refused(orch):
    sbx = await orch.create(CreateRequest())
    snap = await orch.snapshot(sbx.sandbox_id, "snappy")
    req = await orch.request_build(BuildRequest(name="v"))
    with pytest.raises(InvalidRequest, match="building from a sandbox snapshot"):
        await orch.start_build(req.template_id, req.build_id,
                               BuildStart(from_template=snap.snapshot_id))


async def test_start_twice_and_unknown_builds(orch):
    req = await orch.request_build(BuildRequest(name="v"))
    other = await orch.request_build(BuildRequest(name="w"))
    with pytest.raises(InvalidRequest, match="must be a UUID"):
        await orch.start_build(req.template_id, "not-a-uuid", BuildStart(from_image="x"))
    with pytest.raises(BuildNotFound, match="Build '.*' not found"):
        await orch.start_build(req.template_id, str(uuid.uuid4()), BuildStart(from_image="x"))
    with pytest.raises(BuildNotFound):  # a build of another template
        await orch.build_status(req.template_id, other.build_id)
    with pytest.raises(TemplateNotFound):
        await orch.start_build("nosuchtemplate", req.build_id, BuildStart(from_image="x"))
    await orch.start_build("v", req.build_id, BuildStart(from_image="x"))  # by alias too
    with pytest.raises(InvalidRequest, match="build is not in waiting state"):
        await orch.start_build(req.template_id, req.build_id, BuildStart(from_image="x"))


# ---- the build -----------------------------------------------------------------------

async def test_build_runs_the_spec_and_records_the_template(orch, rt, store):
    h = await upload(orch, b"tarball")
    steps = (BuildStep(type="run", args=("echo hi",)),
             BuildStep(type="ADD", args=("a.txt", "/app/"), files_hash=h, force=True),
             BuildStep(type="ARG", args=("A", "1")), BuildStep(type="WORKDIR", args=("/app",)),
             BuildStep(type="USER", args=("root",)))
    req, st = await build(orch, "app", steps=steps, start_cmd="python3 -m http.server 8000",
                          ready_cmd="[ -n \"$(ss -Htuln sport = :8000)\" ]")
    assert st.status == "ready" and st.reason is None
    assert rt.builds == 1  # the default template, built on first use as the source
    (spec,) = rt.build_specs
    # the default template's runtime snapshot (its own id per build: lifecycle.py)
    assert re.fullmatch(r"tmpl-t[a-z0-9]{20}", spec.from_snapshot or "")
    assert spec.from_image is None
    assert [(s.type, s.args, s.files_hash, s.force) for s in spec.steps] == [
        ("RUN", ("echo hi",), None, False), ("COPY", ("a.txt", "/app/", "", ""), h, True),
        ("ENV", ("A", "1"), None, False), ("WORKDIR", ("/app",), None, False),
        ("USER", ("root",), None, False)]
    assert spec.start_cmd == "python3 -m http.server 8000"
    assert spec.ready_cmd == "[ -n \"$(ss -Htuln sport = :8000)\" ]"
    assert spec.files_dir == store.path.parent / "template-files"
    assert spec.machine.image == "default" and spec.snapshot_id.startswith("t")
    assert [(e.level, e.step) for e in st.entries][:2] == [("info", "base"), ("info", "1")]
    assert st.entries[-1].step == "finalize"
    snap = store.get_snapshot(spec.snapshot_id)
    assert snap.kind == "template" and snap.spec["build_id"] == req.build_id
    assert snap.spec["ref"]["facts"]["guest"] == {"user": "root", "workdir": "/app",
                                                  "env": {"A": "1"}}
    (tag,) = await orch.list_tags(req.template_id)
    assert (tag.tag, tag.build_id) == ("default", req.build_id)


async def test_build_from_image_with_credentials(orch, rt):
    req = await orch.request_build(BuildRequest(name="img", cpu_count=2, memory_mb=1024,
                                                min_free_disk_mb=512))
    await orch.start_build(req.template_id, req.build_id, BuildStart(
        from_image="docker.io/library/python:3.12", registry=RegistryAuth("me", "secret"),
        force=True))
    assert (await wait_build(orch, req.template_id, req.build_id)).status == "ready"
    (spec,) = rt.build_specs
    assert spec.from_image == "docker.io/library/python:3.12" and spec.from_snapshot is None
    assert spec.registry == RegistryAuth("me", "secret") and spec.force is True
    assert (spec.machine.cpu_count, spec.machine.memory_mb, spec.machine.disk_mb) == (
        2, 1024, 2048 + 512)
    stored = TemplateStore(orch.store).get_build(req.build_id)
    assert stored.spec["registry_user"] == "me" and "secret" not in repr(stored)


async def test_build_failed_step_is_an_error_with_its_reason(orch):
    req, st = await build(orch, "bad", steps=run("echo ok", "exit 1"))
    assert st.status == "error"
    assert st.reason == "Command 'exit 1' failed with exit code 1" and st.reason_step == "2"
    assert [e.message for e in st.reason_entries] == [
        "exit status 1", "Build failed: Command 'exit 1' failed with exit code 1"]
    assert st.entries[-1].level == "error"
    assert await orch.list_tags(req.template_id) == []
    with pytest.raises(TemplateNotFound, match="no build tagged 'default'"):
        await orch.create(CreateRequest(template_id="bad"))


async def test_other_build_failures_get_a_generic_reason(orch, rt):
    rt.fail["build"] = lambda _: True
    _, st = await build(orch, "broken", from_image="alpine")
    assert st.status == "error" and st.reason == INTERNAL and st.reason_step is None
    assert "injected" not in st.reason


async def test_runtime_build_failed_in_base_step(orch, rt):
    async def failing(spec, log):
        log("error", "pull denied", "base")
        raise BuildFailed("pulling alpine failed", step="base")
    rt.build = failing
    _, st = await build(orch, "nopull", from_image="alpine")
    assert (st.status, st.reason, st.reason_step) == ("error", "pulling alpine failed", "base")


async def test_status_pages_the_log(orch):
    req, st = await build(orch, "paged", steps=run(*(f"echo {i}" for i in range(5))))
    n = len(st.entries)
    first = await orch.build_status(req.template_id, req.build_id, offset=0, limit=3)
    rest = await orch.build_status(req.template_id, req.build_id, offset=3, limit=100)
    assert first.entries + rest.entries == st.entries and len(first.entries) == 3
    assert (await orch.build_status(req.template_id, req.build_id, offset=n)).entries == ()
    debug = await orch.build_status(req.template_id, req.build_id, level="info")
    assert all(e.level != "debug" for e in debug.entries)


# ---- queueing ------------------------------------------------------------------------

async def test_builds_of_one_template_queue_others_run_at_once(orch, rt):
    gate = rt.gates["build"] = asyncio.Event()
    a = await orch.request_build(BuildRequest(name="q"))
    b = await orch.request_build(BuildRequest(name="q:v2"))
    c = await orch.request_build(BuildRequest(name="other"))
    for r in (a, b, c):
        await orch.start_build(r.template_id, r.build_id, BuildStart(from_image="alpine"))
    async with asyncio.timeout(5):
        while len(rt.build_specs) < 2:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert len(rt.build_specs) == 2  # a and c run, b waits for a
    queued = await orch.build_status(b.template_id, b.build_id)
    assert queued.status == "building"
    assert queued.entries[0].message == "Waiting for the previous build of this template to finish"
    gate.set()
    for r in (a, b, c):
        assert (await wait_build(orch, r.template_id, r.build_id)).status == "ready"
    tags = {t.tag: t.build_id for t in await orch.list_tags("q")}
    assert tags == {"default": a.build_id, "v2": b.build_id}
    assert len(orch._ctx.build_queues) == 0  # no queue kept for a template with none waiting


# ---- recovery ------------------------------------------------------------------------

async def test_recovery_fails_interrupted_builds(store, rt, envd):
    """A build that was `building` when the service died is an error after the next
    start, with a clear reason; its committed snapshot and partial uploads are gone."""
    first = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    req = await first.request_build(BuildRequest(name="crash"))
    waiting = await first.request_build(BuildRequest(name="later"))
    # the state a crash mid-build leaves: `building`, part of the log, a committed snapshot
    ts = TemplateStore(store)
    ts.start_build(req.build_id, snapshot_id="tdead", spec={}, now=1.0)
    ts.append_logs(req.build_id, 0, [LogRecord(seq=0, timestamp=1.0, level="info",
                                               message="RUN make", step="1")])
    rt.snapshots["tdead"] = SnapshotRef("tdead", MachineSpec(), 1.0)
    files = store.path.parent / "template-files"
    files.mkdir()
    (files / ".upload-abc.1234").write_bytes(b"half")
    second = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await second.start(ttl_interval_s=3600)
    try:
        st = await second.build_status(req.template_id, req.build_id)
        assert (st.status, st.reason) == ("error", INTERRUPTED)
        assert [e.message for e in st.entries] == ["RUN make", f"Build failed: {INTERRUPTED}"]
        assert ("delete_snapshot", ("tdead",)) in rt.calls
        assert list(files.iterdir()) == []
        assert (await second.build_status(waiting.template_id,
                                          waiting.build_id)).status == "waiting"
    finally:
        await second.aclose()


async def test_shutdown_mid_build_records_an_error(store, rt, envd):
    o = NodeOrchestrator(store, rt, envd=EnvdClient(transport=envd.transport()))
    await o.start(ttl_interval_s=3600)
    rt.gates["build"] = asyncio.Event()  # never set: the build hangs
    req = await o.request_build(BuildRequest(name="slow"))
    await o.start_build(req.template_id, req.build_id, BuildStart(from_image="alpine"))
    await asyncio.sleep(0.01)
    await o.aclose(grace_s=0.05)
    build = TemplateStore(store).get_build(req.build_id)
    assert build.status == "error" and "shutting down" in build.reason["message"]
