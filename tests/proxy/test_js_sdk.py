"""The npm e2b SDK (2.51) against our REST API and, through the proxy, a REAL envd
(E2B_SANDBOX_URL mode). Sandbox lookup uses the in-memory orchestrator double (HTTP-mapping
test only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from host.orchestrator.states import SandboxState
from tests.api.conftest import API_KEY

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "tests" / "js" / "node_modules" / "e2b" / "dist" / "index.mjs"


@pytest.mark.js
def test_js_sdk_rest_and_commands(servers, orch) -> None:
    if shutil.which("node") is None or not SDK.exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    api, proxy = servers
    running = orch.add(token=None, metadata={"team name": "x/y&z"})
    paused = orch.add(token=None, metadata={"team name": "x/y&z"}, state=SandboxState.PAUSED)
    orch.add(metadata={"team name": "other"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_API_URL": api.url, "E2B_SANDBOX_URL": proxy.url, "E2B_API_KEY": API_KEY,
                "E2B_DOMAIN": "sbx.test", "E2B_JS_SDK": SDK.as_uri()})
    res = subprocess.run(["node", str(Path(__file__).with_name("js_sdk.mjs")),
                          running.sandbox_id, paused.sandbox_id],
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(out["listed"]) == sorted([running.sandbox_id, paused.sandbox_id])
    assert out["info"] == {"id": running.sandbox_id, "state": "running", "envdVersion": "0.6.13"}
    assert out["pausePaused"] is False
    assert out["notFound"] == "SandboxNotFoundError"
    assert out["killUnknown"] is False
    assert out["run"]["exitCode"] == 0 and out["run"]["stdout"] == "one\ntwo\n"
    assert out["file"] == "via proxy"
    assert out["killed"] is True
