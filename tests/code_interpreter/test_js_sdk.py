"""The unmodified @e2b/code-interpreter JS SDK (tests/js, debug mode) against the server:
tests/js/code_interpreter.mjs (state, png, error, streaming, envs, timeout, contexts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import CIServer

pytestmark = pytest.mark.js

JS_DIR = Path(__file__).resolve().parents[1] / "js"


def test_js_sdk_code_interpreter(ci_server: CIServer) -> None:
    if shutil.which("node") is None or not (
            JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir():
        pytest.skip("node or the @e2b/code-interpreter npm package is not installed "
                    "(npm install in tests/js)")
    workdir = ci_server.home / "js"
    workdir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_DEBUG": "true", "E2B_API_KEY": "e2b_unused_in_debug_mode"})
    r = subprocess.run(["node", "code_interpreter.mjs", str(workdir)], cwd=JS_DIR, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "ALL PASSED" in r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary == {"answer": "42", "png": True, "errorName": "ValueError",
                       "streamed": True, "interrupted": True, "isolated": True}
