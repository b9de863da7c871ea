"""The npm e2b SDK (tests/js/node_modules, 2.51.0) against the real service: tests/js/e2e.mjs
(create, commands.run, files, pause/connect, kill), mode B env."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.orchestrator.hostproc import REPO

from .conftest import E2EService

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.js]

JS = REPO / "tests" / "js"


def test_js_sdk_flows(service: E2EService) -> None:
    if shutil.which("node") is None or not (JS / "node_modules" / "e2b").exists():
        pytest.skip("node or tests/js/node_modules/e2b missing (npm ci in tests/js)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(service.sdk_env())
    env["E2B_DOMAIN"] = "sbx.localhost"
    r = subprocess.run(["node", str(JS / "e2e.mjs")], env=env, cwd=JS, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\njs phases (ms since start): {out['t']}")
    assert out["run"] == "hi\nbar\n" and out["file"] == "hello from js"
    assert out["tmpFs"] not in ("", "tmpfs"), out
    assert out["tools"].startswith("Python 3") and out["tools"].endswith("tools-ok\n"), out
    assert out["resumed"] and out["killed"] and out["notFound"]
