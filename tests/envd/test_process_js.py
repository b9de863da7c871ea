"""process.Process through the official e2b npm SDK (tests/js/process.mjs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import sdk_environ

JS_DIR = Path(__file__).resolve().parents[1] / "js"

pytestmark = pytest.mark.js


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.skipif(not (JS_DIR / "node_modules" / "e2b").is_dir(),
                    reason="npm e2b SDK not installed in tests/js")
def test_js_sdk_process(envd_url):
    env = {k: v for k, v in os.environ.items() if k != "E2B_SANDBOX_URL"}
    env.update(sdk_environ(envd_url))
    proc = subprocess.run(["node", "process.mjs"], cwd=JS_DIR, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for name in ("run", "stream", "exit code", "background + sendStdin + closeStdin",
                 "list + connect + kill", "timeout", "pty"):
        assert f"ok {name}\n" in proc.stdout
    assert proc.stdout.endswith("all ok\n")
