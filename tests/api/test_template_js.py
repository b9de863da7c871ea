"""The npm e2b SDK (2.51) builds a template over real HTTP against the REST API on a real
`NodeOrchestrator` with the fake runtime (no VM): tests/api/template_js.mjs runs
`Template.build` (COPY upload included), creates a sandbox from the result, and checks
the BuildError of a failing step and of a missing fromTemplate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import API_KEY, ServerThread
from .template_service import DOMAIN, NodeService

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "tests" / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"

pytestmark = pytest.mark.js


def test_js_template_build(tmp_path) -> None:
    if shutil.which("node") is None or not SDK.exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "a.txt").write_text("hello\n")
    svc = NodeService(tmp_path / "state")
    try:
        with ServerThread(svc, lifespan="on") as srv:
            env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
            env.update({"E2B_API_URL": srv.url, "E2B_API_KEY": API_KEY, "E2B_DOMAIN": DOMAIN,
                        "E2B_JS_SDK": SDK.as_uri()})
            res = subprocess.run(["node", str(Path(__file__).with_name("template_js.mjs")),
                                  str(ctx)], env=env, capture_output=True, text=True,
                                 timeout=120, check=False)
    finally:
        svc.close_store()
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["info"]["tags"] == ["v1"] and out["exists"] is True
    assert "RUN echo hi" in out["logs"] and "Uploaded 'a.txt'" in out["logs"]
    assert out["sandboxTemplate"] == out["info"]["templateId"]
    spec = svc.runtime.build_specs[0]
    assert [(s.type, s.args) for s in spec.steps] == [
        ("RUN", ("echo hi",)), ("COPY", ("a.txt", "/app/", "", "")), ("ENV", ("A", "1")),
        ("WORKDIR", ("/app",)), ("USER", ("user",))]
    assert spec.ready_cmd == '[ -n "$(ss -Htuln sport = :8000)" ]'
    assert spec.steps[1].files_hash and (svc.files_dir / spec.steps[1].files_hash).is_file()
    _, body, _ = svc.envd.inits[-1]
    assert (body["defaultWorkdir"], body["envVars"]) == ("/app", {"A": "mine"})
    assert out["failed"] == {"name": "BuildError",
                             "message": "Command 'exit 1' failed with exit code 1"}
    assert out["missing"]["name"] == "BuildError"
    assert "400: fromTemplate 'nope'" in out["missing"]["message"]
