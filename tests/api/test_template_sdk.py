"""The real Python e2b SDK (2.63) builds templates over real HTTP against the REST API on
a real `NodeOrchestrator` whose runtime is the fake (no VM; tests/api/template_service.py):
`Template.build` end to end (request, COPY upload to the signed URL, start, log polling),
the exact steps and start/ready commands the runtime receives, sandboxes from the result,
tags and aliases, and the SDK's exceptions for bad builds."""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import uuid

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_port
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import TemplateException
from e2b.template_sync.build_api import request_build, trigger_build

from .conftest import API_KEY
from .template_service import DOMAIN, NodeService, node_service  # noqa: F401 (fixture)

READY_8000 = '[ -n "$(ss -Htuln sport = :8000)" ]'


@pytest.fixture
def svc(node_service: NodeService, monkeypatch):  # noqa: F811 - the imported fixture
    """The service, with the SDK pointed at it through the environment."""
    monkeypatch.setenv("E2B_API_URL", node_service.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_DOMAIN", DOMAIN)
    for var in ("E2B_DEBUG", "E2B_SANDBOX_URL", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    return node_service


@pytest.fixture
def context(tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "a.txt").write_text("hello\n")
    os.chmod(ctx / "a.txt", 0o644)
    return ctx


def copy_hash(src: str, dest: str, root) -> str:
    """§4a: sha256 of "COPY src dest", then per file: relative path, mode, size, bytes."""
    st = os.stat(root / src)
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for part in (src, str(st.st_mode), str(st.st_size)):
        h.update(part.encode())
    h.update((root / src).read_bytes())
    return h.hexdigest()


def test_template_build_end_to_end(svc, context):
    t = (Template(file_context_path=context).from_template("base").run_cmd("echo hi")
         .copy("a.txt", "/app/").set_envs({"A": "1", "B": "2"}).set_workdir("/app")
         .set_user("user").set_start_cmd("python3 -m http.server 8000", wait_for_port(8000)))
    logs = []
    info = Template.build(t, "my-tpl", on_build_logs=logs.append)
    assert info.name == "my-tpl" and info.tags == ["default"]
    messages = [e.message for e in logs]
    # the runtime's log; the default template's runtime snapshot has its own id per build
    assert any(re.fullmatch(r"FROM tmpl-t[a-z0-9]{20}", m) for m in messages), messages
    assert "RUN echo hi" in messages
    assert "Uploaded 'a.txt'" in messages and messages[-1] == "Build finished"
    (spec,) = svc.runtime.build_specs
    h = copy_hash("a.txt", "/app/", context)
    assert [(s.type, s.args, s.files_hash) for s in spec.steps] == [
        ("RUN", ("echo hi",), None), ("COPY", ("a.txt", "/app/", "", ""), h),
        ("ENV", ("A", "1", "B", "2"), None), ("WORKDIR", ("/app",), None),
        ("USER", ("user",), None)]
    assert spec.start_cmd == "python3 -m http.server 8000" and spec.ready_cmd == READY_8000
    assert re.fullmatch(r"tmpl-t[a-z0-9]{20}", spec.from_snapshot or "")
    assert spec.files_dir == svc.files_dir
    with tarfile.open(fileobj=io.BytesIO((svc.files_dir / h).read_bytes()), mode="r:gz") as tar:
        assert tar.extractfile("a.txt").read() == b"hello\n"

    sbx = Sandbox.create(template="my-tpl", envs={"B": "mine"})
    assert sbx.sandbox_id in {r.id for r in svc.store.list_sandboxes()}
    _, body, _ = svc.envd.inits[-1]
    assert (body["defaultUser"], body["defaultWorkdir"]) == ("user", "/app")
    assert body["envVars"] == {"A": "1", "B": "mine"}
    assert sbx.get_info().template_id == info.template_id
    sbx.kill()

    # a second build of the same files: the SDK skips the upload (present)
    logs.clear()
    Template.build(t, "my-tpl:v2", on_build_logs=logs.append)
    assert "Skipping upload of 'a.txt', already cached" in [e.message for e in logs]
    assert Template.exists("my-tpl") and Template.exists("my-tpl:v2")
    assert not Template.exists("other")
    assert sorted(tag.tag for tag in Template.get_tags("my-tpl")) == ["default", "v2"]
    assigned = Template.assign_tags("my-tpl:v2", ["stable"])
    assert assigned.tags == ["stable"]
    Template.remove_tags("my-tpl", ["stable"])
    with pytest.raises(TemplateException, match="cannot be removed"):
        Template.remove_tags("my-tpl", ["default"])


def test_failing_run_is_a_build_exception_with_the_steps_message(svc):
    t = Template().from_template("base").run_cmd("echo ok").run_cmd("exit 1")
    logs = []
    with pytest.raises(BuildException, match="Command 'exit 1' failed with exit code 1"):
        Template.build(t, "broken", on_build_logs=logs.append)
    assert any(e.level == "error" and e.message.startswith("Build failed") for e in logs)


def test_missing_from_template(svc):
    with pytest.raises(BuildException, match="400: fromTemplate 'nope'"):
        Template.build(Template().from_template("nope").run_cmd("true"), "child")


def test_crafted_bad_steps(svc):
    client = get_api_client(ConnectionConfig())
    req = request_build(client, "crafted", None, None, None, None)
    base = {"fromTemplate": "base", "force": False}
    with pytest.raises(BuildException, match="400: step 1: command type 'FROB'"):
        trigger_build(client, req.template_id, req.build_id,
                      {**base, "steps": [{"type": "FROB", "args": [], "force": False}]})
    never = hashlib.sha256(b"never uploaded").hexdigest()
    with pytest.raises(BuildException, match="were never uploaded"):
        trigger_build(client, req.template_id, req.build_id, {**base, "steps": [
            {"type": "COPY", "args": ["x", "/x", "", ""], "filesHash": never, "force": False}]})
    with pytest.raises(BuildException, match="404"):
        trigger_build(client, "nosuchtemplate", req.build_id, {**base, "steps": []})
    with pytest.raises(BuildException, match="400: Build '.*' not found"):
        trigger_build(client, req.template_id, str(uuid.uuid4()), {**base, "steps": []})
    trigger_build(client, req.template_id, req.build_id, {**base, "steps": []})
    with pytest.raises(BuildException, match="build is not in waiting state"):
        trigger_build(client, req.template_id, req.build_id, {**base, "steps": []})


def test_name_conflicts(svc):
    with pytest.raises(BuildException, match="403: Alias 'base' already used"):
        Template.build(Template().from_template("base"), "base")
    with pytest.raises(BuildException, match="400: namespace 'someone'"):
        Template.build(Template().from_template("base"), "someone/app")
