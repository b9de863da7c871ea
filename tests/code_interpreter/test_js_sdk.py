"""The unmodified @e2b/code-interpreter JS SDK (tests/js, debug mode) against the server:
tests/js/code_interpreter.mjs (state, png, error, streaming, envs, timeout, contexts) and
tests/js/code_interpreter_languages.mjs (the battery of languages.json, every language)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from . import battery
from .conftest import SANDBOX_ENVS, CIServer

pytestmark = pytest.mark.js

JS_DIR = Path(__file__).resolve().parents[1] / "js"


def _node(*args: str) -> dict[str, object]:
    if shutil.which("node") is None or not (
            JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir():
        pytest.skip("node or the @e2b/code-interpreter npm package is not installed "
                    "(npm install in tests/js)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_DEBUG": "true", "E2B_API_KEY": "e2b_unused_in_debug_mode"})
    r = subprocess.run(["node", *args], cwd=JS_DIR, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "ALL PASSED" in r.stdout
    summary: dict[str, object] = json.loads(r.stdout.strip().splitlines()[-1])
    return summary


def test_js_sdk_code_interpreter(ci_server: CIServer) -> None:
    workdir = ci_server.home / "js"
    workdir.mkdir(exist_ok=True)
    summary = _node("code_interpreter.mjs", str(workdir))
    assert summary == {"answer": "42", "png": True, "errorName": "ValueError",
                       "streamed": True, "interrupted": True, "isolated": True}


def test_js_sdk_every_language(ci_server: CIServer) -> None:
    other = ci_server.home / "js-elsewhere"
    other.mkdir(exist_ok=True)
    summary = _node("code_interpreter_languages.mjs", str(ci_server.home), str(other),
                    f"AENV_SANDBOX_VAR={SANDBOX_ENVS['AENV_SANDBOX_VAR']}")
    assert summary == {language: True for language in battery.LANGUAGES}
