"""The official e2b JS SDK against envd's filesystem RPCs and /files (tests/js/files.mjs)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.envd.test_http_endpoints import private_envd

JS_DIR = Path(__file__).resolve().parents[1] / "js"
USER = pwd.getpwnam("user")

pytestmark = pytest.mark.js


def test_js_sdk_files(home_dir):
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "e2b").is_dir():
        pytest.skip("node or the e2b npm package is not installed")
    with private_envd() as (url, _):
        env = {**os.environ, "E2B_DEBUG": "true", "E2B_API_KEY": "x", "E2B_SANDBOX_URL": url}
        r = subprocess.run(["node", "files.mjs", str(home_dir)], cwd=JS_DIR, env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "ALL PASSED" in r.stdout
    # everything the SDK wrote belongs to the default user
    assert (home_dir / "sub" / "a.txt").stat().st_uid == USER.pw_uid
